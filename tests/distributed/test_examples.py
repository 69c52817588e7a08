"""The multi-process examples also run alone (one process, the 8 simulated devices here) and
match one device; under ``parallax launch`` they run in test_multiprocess.py (Horovod's in
tests/horovod/test_multiprocess.py)."""

import importlib.util
import pathlib

import pytest

EXAMPLES = pathlib.Path(__file__).parents[2] / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize("args", [
    ["--steps", "3", "--loader", "plain"],
    ["--steps", "3", "--loader", "plain", "--strategy", "dp-tree"],
    pytest.param(["--steps", "3", "--strategy", "fsdp", "--loader", "grain"],
                 marks=pytest.mark.skipif(importlib.util.find_spec("grain") is None,
                                          reason="grain is optional (pip install grain)")),
])
def test_multiprocess_dp_fsdp_alone(args, capsys):
    assert load("multiprocess_dp_fsdp").main(args) == 0
    assert "relative difference vs one device" in capsys.readouterr().out


def test_horovod_train_alone(capsys):
    assert load("horovod_train").main(["--steps", "3", "--check"]) == 0
    assert "rank 0: matches the one-process run" in capsys.readouterr().out
