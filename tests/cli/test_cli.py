import json
import os
import shutil
import sys

import pytest

from parallax import cli
from parallax.cli import presets
from tests.distributed.launching import Started


def test_presets_parse_names_into_meshes_and_strategies():
    axes, strategy = presets.parse("dp+fsdp+tp")
    assert axes == {"tensor": 2, "fsdp": 2, "data": 2}
    assert strategy.batch_axes == ("data", "fsdp") and strategy.zero_stage == 3
    assert presets.parse("zero2")[0] == {"fsdp": 8}
    assert presets.parse("tp")[0] == {"tensor": 2}
    assert presets.parse("hsdp")[1].zero_stage == 3
    assert dict(presets.parse("dp+tp-sp")[1].rules)["sequence"] == "tensor"


def test_presets_fit_the_devices_present():
    # One GPU, two, six: the default still runs, on what there is.
    assert presets.parse("dp+fsdp+tp", devices=1)[0] == {"tensor": 1, "fsdp": 1, "data": 1}
    assert presets.parse("dp+fsdp+tp", devices=2)[0] == {"tensor": 2, "fsdp": 1, "data": 1}
    assert presets.parse("dp+fsdp+tp", devices=6)[0] == {"tensor": 2, "fsdp": 1, "data": 3}
    assert presets.parse("dp+tp", tensor=4, devices=6)[0] == {"tensor": 3, "data": 2}
    assert presets.parse("zero3", devices=1)[0] == {"fsdp": 1}
    with pytest.raises(ValueError, match=r"parallax: devices=0 and tensor=2 must be >= 1"):
        presets.parse("dp", devices=0)


def test_unknown_preset():
    with pytest.raises(ValueError, match=r"unknown strategy 'dp\+pp'; combine parts with '\+' from dp, zero1"):
        presets.parse("dp+pp")


@pytest.mark.slow
@pytest.mark.timeout(900)  # its process has 600 s (launching.Started)
def test_demo_runs_from_the_command_line():
    # The README's command as installed (the console script), on a fresh process that
    # simulates its own devices; python -m parallax.cli where the script is not on PATH.
    script = shutil.which("parallax")
    command = [script] if script else [sys.executable, "-m", "parallax.cli"]
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if "xla_force_host_platform_device_count" not in f)
    out = Started(command + ["demo", "--steps", "4", "--quiet"], timeout=600, cwd=None,
                  env=env).finish()
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "no accelerator found: 8 simulated CPU devices" in text
    assert "strategy dp+fsdp+tp on data=2 x fsdp=2 x tensor=2 (8 cpu devices)" in text
    assert "largest relative loss difference vs one device" in text
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        assert kind in text


@pytest.mark.slow
def test_demo_flags_and_progress_bar(capsys, tmp_path):
    # In this process (8 devices already simulated): another strategy, a progress bar with
    # px.metrics, a metrics log and a profile of step 2.
    assert cli.main(["demo", "--strategy", "zero2+tp-sp", "--tensor", "4", "--steps", "3",
                     "--batch", "8", "--logdir", str(tmp_path), "--profile-steps", "2:3"]) == 0
    out, err = capsys.readouterr()
    assert "strategy zero2+tp-sp on fsdp=2 x tensor=4 (8 cpu devices)" in out
    assert "reduce-scatter" in out
    assert "3/3" in err and "tok/s/dev=" in err and "MFU=" in err  # tqdm's bar, on stderr
    assert "throughput (px.metrics)" in out and "tokens/s per device" in out
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["items_per_second"] > 0 and r["mfu"] > 0 for r in rows)
    assert list(tmp_path.glob("plugins/profile/*/perfetto_trace.json.gz"))
