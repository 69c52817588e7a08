"""parallax.horovod across real processes, through ``parallax launch`` (gloo on localhost):
every collective equals numpy on the gathered inputs, broadcasts make differently seeded
processes identical, and the optimizer trains to the full-batch numbers. Here 4 processes of
one device; the 2 x 2 run, with the Horovod-style example against one process, shares the
launch of tests/distributed/test_multiprocess.py (fewer process starts)."""

import re

import pytest

from tests.distributed.launching import run_launcher

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

PROGRAM = "tests/horovod/programs/collectives.py"
CHECKS = 27  # "ok ..." lines each rank prints


def assert_horovod_agrees(text: str, ranks: int, train: bool) -> None:
    """Every rank printed every ``ok`` check, ``all agree``, and (train) the example's match."""
    for rank in range(ranks):
        assert len(re.findall(rf"^\[{rank}\] ok ", text, re.M)) == CHECKS, text[-3000:]
        assert f"[{rank}] all agree" in text
        if train:
            match = re.search(rf"^\[{rank}\] rank {rank}: matches the one-process run: losses "
                              r"([\d.e+-]+), parameters ([\d.e+-]+)", text, re.M)
            assert match and max(float(match.group(1)), float(match.group(2))) <= 1e-5


def test_collectives_across_four_processes():
    out = run_launcher(["-np", "4", "python", PROGRAM])
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert_horovod_agrees(out.stdout, 4, train=False)
