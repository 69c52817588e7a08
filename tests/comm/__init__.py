"""Tests of parallax.comm (a package, so its test module names cannot clash)."""
