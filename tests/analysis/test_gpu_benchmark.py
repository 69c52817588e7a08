"""benchmarks/gpu.sh runs on CPU (GPT tiny) and appends its rows to a RESULTS.md."""

import os
import pathlib
import sys

import pytest

from tests.distributed.launching import Started

ROOT = pathlib.Path(__file__).parents[2]


@pytest.mark.slow
@pytest.mark.timeout(900)  # its process has 600 s (launching.Started)
def test_gpu_benchmark_runs_on_cpu_with_the_tiny_config(tmp_path):
    results = tmp_path / "RESULTS.md"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHON=sys.executable)
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if "xla_force_host_platform_device_count" not in f)
    done = Started(["bash", ROOT / "benchmarks" / "gpu.sh", "--tiny", "--results", results],
                   timeout=600, cwd=None, env=env).finish()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "px/jit" in done.stdout and "MFU px" in done.stdout and "all_reduce" in done.stdout
    text = results.read_text()
    step_rows = [line for line in text.splitlines() if "| tiny |" in line]
    assert len(step_rows) == 1 and "| cpu" in step_rows[0]
    assert "## Collectives (parallax bench comm)" in text and "| all_reduce | xla |" in text
