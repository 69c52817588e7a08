"""The default gradient sum across CPU processes, launched for real (2 processes, gloo).

``px.DataParallel("data")`` over a data axis that spans two ``parallax launch`` ed
processes compiles each gradient's sum to one ``collective-permute`` exchange (no gradient
all-reduce), says so in ``px.explain``, and trains a stock Flax model to the one-device
losses and whole state (parameters, Adam's moments, step) after every step; ``sync="xla"``
compiles to XLA's all-reduce and trains to the same numbers. (The decision table on
described meshes, and one process keeping XLA's all-reduce: tests/test_sync.py.)
"""

import re
import sys

import pytest

from tests.distributed.launching import program, run_launcher

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


def test_the_default_exchanges_gradients_across_processes_and_trains_like_one_device():
    done = run_launcher(["-np", "2", sys.executable, program("default_sync.py"),
                         "--steps", "3"], timeout=400)
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    for rank in (0, 1):
        results = re.findall(rf"^\[{rank}\] agree (.*)$", out, re.M)
        assert len(results) == 3, out[-3000:]
        assert re.search(r'"sync": "None", .*"permutes": 6, "all-reduce bytes": 0', results[0])
        assert re.search(r'"sync": "\'xla\'", .*"permutes": 0', results[1])
        assert '"tree vs xla"' in results[2]
