"""Every test runs on 8 simulated CPU devices, set before JAX first touches a device.

Two settings keep the suite inside its time budget on a 2-core machine, where XLA
compilation is most of the time (measured: a GPT equivalence test spent 16 s of 24 s
compiling). Both are inherited by the subprocesses the tests start (CLI, notebook kernels):

- ``--xla_backend_optimization_level=0``: LLVM optimises the CPU code less. Programs run
  slower, but the tests run tiny models for a few steps, so compiling dominates (that test:
  42 s -> 24 s). HLO passes, and so the collectives and ``memory_analysis`` the tests read,
  are unchanged.
- a persistent compilation cache shared by the test processes (pytest-xdist workers,
  notebook kernels, the CLI): tests that build the same program anew (a fresh
  ``@px.train_step`` closure, the one-device reference) load it instead of compiling
  (the same test run twice: 24 s -> 11 s). JAX keys entries by the program, the flags and
  the versions, so an entry can never be stale. (Multi-process CPU jobs turn it off in
  their processes: parallax.distributed.compilation_cache.)

No test can hang the run or leave a process behind: a test still running after the
``timeout`` of pyproject.toml fails with every thread's stack (pytest-timeout); a test reads
what it started through tests/distributed/launching.py's ``Started``, with a deadline that
kills the process and everything it started; and tests/process_guard.py stops what a test
left running and sweeps the session's leftovers at its end, reporting them.
"""

import os
import pathlib
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_backend_optimization_level=0").strip()
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      str(pathlib.Path(tempfile.gettempdir()) / "parallax-test-jax-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_default_matmul_precision", "highest")

from process_guard import (  # noqa: E402, F401  (no test leaves a process running)
    _processes_of_each_test_are_stopped, pytest_sessionfinish, pytest_terminal_summary,
    pytest_testnodedown)
from ray_fixtures import ray_cluster  # noqa: E402, F401  (one Ray cluster per test session)
from memory_guard import _caches_dropped_after_a_heavy_module  # noqa: E402, F401
