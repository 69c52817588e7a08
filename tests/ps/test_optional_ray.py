"""Ray is an optional extra: importing parallax (and parallax.ps, parallax.tf) loads none of it."""

import os
import sys

import pytest

from tests.distributed.launching import Started


@pytest.mark.slow
def test_import_parallax_does_not_import_ray():
    code = ("import sys, parallax, parallax.ps, parallax.tf; "
            "parallax.ps.BoundedDelay(1); parallax.tf.FixedShardsPartitioner(2); "
            "assert 'ray' not in sys.modules, 'ray was imported'; "
            "parallax.ps.KVStore; assert 'ray' in sys.modules")
    done = Started([sys.executable, "-c", code], timeout=120, cwd=None,
                   env=dict(os.environ)).finish()
    assert done.returncode == 0, done.stderr[-3000:]
