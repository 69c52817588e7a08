"""Tests of parallax.nn (a package, so its test module names cannot clash)."""
