"""Keeps a long-lived pytest-xdist worker's memory bounded.

Each test compiles its own programs, and JAX keeps every compiled executable while anything
(a ``functools.cache`` of a test module, a strategy's cache) still refers to its function:
over a whole run one worker grew past 20 GB on a 24 GiB machine. After each test module,
a worker holding more than ``LIMIT_MB`` resident drops JAX's in-memory caches
(``jax.clear_caches``; the persistent compilation cache keeps later compiles cheap).
"""

import gc

import jax
import psutil
import pytest

LIMIT_MB = 3000


@pytest.fixture(autouse=True, scope="module")
def _caches_dropped_after_a_heavy_module():
    yield
    if psutil.Process().memory_info().rss > LIMIT_MB * 2**20:
        jax.clear_caches()
        gc.collect()
