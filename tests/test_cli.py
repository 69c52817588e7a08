import os
import subprocess
import sys

import pytest

from parallax import presets


def test_presets_parse_names_into_meshes_and_strategies():
    axes, strategy = presets.parse("dp+fsdp+tp")
    assert axes == {"tensor": 2, "fsdp": 2, "data": -1}
    assert strategy.batch_axes == ("data", "fsdp") and strategy.zero_stage == 3
    assert presets.parse("zero2")[0] == {"fsdp": -1}
    assert presets.parse("tp")[0] == {"tensor": -1}
    assert presets.parse("hsdp")[1].zero_stage == 3
    assert dict(presets.parse("dp+tp-sp")[1].rules)["sequence"] == "tensor"


def test_unknown_preset():
    with pytest.raises(ValueError, match=r"unknown strategy 'dp\+pp'; combine parts with '\+' from dp, zero1"):
        presets.parse("dp+pp")


@pytest.mark.slow
def test_demo_runs_from_the_command_line():
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
    out = subprocess.run(
        [sys.executable, "-m", "parallax.cli", "demo", "--steps", "4", "--quiet"],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "no accelerator found: 8 simulated CPU devices" in text
    assert "strategy dp+fsdp+tp on data=2 x fsdp=2 x tensor=2 (8 cpu devices)" in text
    assert "largest relative loss difference vs one device" in text
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        assert kind in text
