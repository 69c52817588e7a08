"""A launched job with a warm persistent compilation cache finishes, run after run; JAX alone
hangs there with jax 0.12 (parallax.distributed.compilation_cache says why).

The program (programs/cached_sum.py) sums over 2 processes x 2 CPU devices. Its first run,
with ``jax.distributed`` alone, writes process 0's compiled program to a fresh cache
directory; JAX keys entries by each process's devices and only process 0 writes, so on the
next runs process 0 loads the program and process 1 compiles it.
"""

import re
import sys

import jax
import pytest

from tests.distributed.launching import program, run_launcher
from tests.distributed.launching import test_env as launch_env

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

# Seen with jax/jaxlib 0.12.1; 0.10.2 runs a loaded and a freshly compiled program together.
JAX_HANGS = tuple(jax.__version_info__[:2]) >= (0, 12)


def run(cache, *flags, timeout=120):
    env = launch_env(JAX_COMPILATION_CACHE_DIR=str(cache),
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return run_launcher(["-np", "2", "--devices-per-process", "2", "--grace", "1",
                         sys.executable, program("cached_sum.py"), *flags],
                        timeout=timeout, env=env)


def assert_summed(done, cache: str):
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for rank in (0, 1):
        assert f"[{rank}] rank {rank}: cache {cache}" in done.stdout, done.stdout[-3000:]
        assert re.search(rf"^\[{rank}\] rank {rank}: sum 384\.0 in", done.stdout, re.M)


def warm_cache(directory):
    """JAX alone on a cold cache: every process compiles, process 0 writes its entry."""
    assert_summed(run(directory, "--jax-only"), cache="on")
    entries = sorted(directory.glob("jit_total-*"))
    assert len(entries) == 1, sorted(directory.iterdir())
    return entries


def test_a_launched_job_with_a_warm_cache_finishes_every_time(tmp_path):
    entries = warm_cache(tmp_path)
    # px.distributed.initialize() turns the cache off, also after jax.distributed's own
    for flags in ((), ("--jax-first",)):
        assert_summed(run(tmp_path, *flags), cache="off")
    assert sorted(tmp_path.glob("jit_total-*")) == entries


def test_jax_alone_with_a_warm_cache(tmp_path):
    warm_cache(tmp_path)
    if not JAX_HANGS:
        assert_summed(run(tmp_path, "--jax-only"), cache="on")
        return
    # Both processes wait in gloo's all-reduce for good; the deadline kills the launcher
    # and both ranks (the test's guard checks that none is left).
    with pytest.raises(AssertionError, match=r"did not finish within 45 s; killed 3 "
                                             r"processes") as hung:
        run(tmp_path, "--jax-only", timeout=45)
    said = str(hung.value)
    assert "[0] rank 0: cache on" in said and not re.search(r"rank \d: sum", said), said
