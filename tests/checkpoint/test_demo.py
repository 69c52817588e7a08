"""``parallax demo --checkpoint-dir DIR`` resumes where the previous demo stopped."""

import re

import pytest

from parallax import cli
from parallax.cli import demo


def test_the_demo_takes_a_checkpoint_directory():
    args = cli.build_parser().parse_args(["demo", "--checkpoint-dir", "runs/demo"])
    assert args.checkpoint_dir == "runs/demo"
    assert cli.build_parser().parse_args(["demo"]).checkpoint_dir is None


@pytest.mark.slow
def test_the_demo_resumes_from_its_checkpoint(tmp_path):
    first = demo.run(steps=2, batch=8, progress=False, checkpoint_dir=tmp_path)
    assert first.resumed_from is None and len(first.losses) == 2
    second = demo.run(steps=5, batch=8, progress=False, checkpoint_dir=tmp_path)
    assert second.resumed_from == 2 and second.losses[:2] == first.losses
    assert len(second.losses) == 5 and demo.loss_gap_ok(second)  # every step vs one device
    assert (f"checkpoints in {tmp_path}: resumed from step 2, saved step 5"
            in demo.report(second))
    with pytest.raises(ValueError, match=re.escape(
            f"parallax demo: the checkpoint in {tmp_path} was trained with {{'batch': 8, "
            "'learning_rate': 0.003}, this run asks for {'batch': 16, 'learning_rate': 0.003}; "
            "pass the same values to resume it, or another --checkpoint-dir.")):
        demo.run(steps=6, batch=16, progress=False, checkpoint_dir=tmp_path)
    with pytest.raises(ValueError, match=re.escape(
            f"parallax demo: the checkpoint in {tmp_path} is at step 5, past --steps 4; pass "
            "--steps 5 or more to resume it.")):
        demo.run(steps=4, batch=8, progress=False, checkpoint_dir=tmp_path)
