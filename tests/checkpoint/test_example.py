"""examples/resumable_train.py: a run stopped and started again equals one straight run."""

import pathlib
import runpy

import pytest

EXAMPLE = pathlib.Path(__file__).parents[2] / "examples" / "resumable_train.py"


@pytest.mark.slow
def test_a_stopped_and_resumed_run_equals_a_straight_one(tmp_path, capsys):
    main = runpy.run_path(str(EXAMPLE))["main"]
    common = ["--steps", "3", "--save-every", "2", "--batch", "8"]
    straight = main(common + ["--checkpoint-dir", str(tmp_path / "straight")])
    main(common + ["--checkpoint-dir", str(tmp_path / "run"), "--stop-after", "2"])
    resumed = main(common + ["--checkpoint-dir", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert "stopping after step 2 (the newest checkpoint is step 2)" in out
    assert f"resumed from step 2 of {tmp_path / 'run'} (saved under dp+fsdp+tp)" in out
    assert resumed == straight and len(straight) == 3  # bitwise: same mesh and strategy
