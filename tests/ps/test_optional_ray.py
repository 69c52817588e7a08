"""Ray is an optional extra: importing parallax (and parallax.ps, parallax.tf) loads none of it."""

import subprocess
import sys

import pytest


@pytest.mark.slow
def test_import_parallax_does_not_import_ray():
    code = ("import sys, parallax, parallax.ps, parallax.tf; "
            "parallax.ps.BoundedDelay(1); parallax.tf.FixedShardsPartitioner(2); "
            "assert 'ray' not in sys.modules, 'ray was imported'; "
            "parallax.ps.KVStore; assert 'ray' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
