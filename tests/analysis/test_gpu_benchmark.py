"""benchmarks/gpu.sh runs on CPU (tiny GPT and Llama, float32) and appends its rows to a
RESULTS.md: the batch sweep, MFU, tokens/s, memory, px / hand-written, the attention kernel."""

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
    out = done.stdout
    assert "px/hand" in out and "MFU" in out and "tokens/s" in out and "all_reduce" in out
    assert "fused attention check, gpt_tiny: n/a on cpu in float32 (runs xla)" in out
    assert "6 N + 12 L T D per token" in out and "llama_tiny: px.explain predicts" in out
    text = results.read_text()
    sweep = text.split("## Train step, batch sweep")[1].split("\n## ")[0]
    for model in ("gpt_tiny", "llama_tiny"):
        rows = [line for line in sweep.splitlines() if f"| {model} |" in line]
        assert rows and all("| cpu" in r and "| float32 | none | xla |" in r for r in rows)
        assert rows[-1].rstrip(" |").split("|")[-1].strip() != "-"  # px / hand-written
    assert "## Collectives (parallax bench comm)" in text and "| all_reduce | xla |" in text
    # The float8 row: Llama tiny's step and the same under px.Float8(), alternating.
    assert "llama_tiny float8 vs float32 at batch" in out
    section = text.split("## float8 against bf16")[1].split("\n## ")[0]
    fp8 = [line for line in section.splitlines() if "| llama_tiny |" in line]
    assert len(fp8) == 1 and "| float32 |" in fp8[0]
    assert float(fp8[0].rstrip(" |").split("|")[-1]) > 0  # bf16 / float8 time


def test_the_fused_attention_check_reads_the_kernel_summary():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert gpu.fused_check("gpu", "bfloat16", "cudnn (4 fused calls)").startswith("PASS")
    for ran in ("cudnn (NO fused call in the program)", "xla"):
        assert gpu.fused_check("gpu", "bfloat16", ran).startswith("FAIL"), ran
    assert gpu.fused_check("gpu", "float32", "xla").startswith("n/a")


def test_rows_go_to_their_own_table_when_another_follows_it(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    path = tmp_path / "RESULTS.md"
    path.write_text("# R\n\n## First\n\n| a |\n|---|\n| 1 |\n\n## Second\n\n| b |\n|---|\n| 2 |\n")
    gpu.append_rows(path, "First", "| a |", ["| 3 |"])
    assert path.read_text() == ("# R\n\n## First\n\n| a |\n|---|\n| 1 |\n| 3 |\n\n## Second\n\n"
                                "| b |\n|---|\n| 2 |\n")
