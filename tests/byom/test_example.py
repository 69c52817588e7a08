"""examples/stock_cnn.py runs and matches one device."""

import importlib.util
import pathlib

import pytest

PATH = pathlib.Path(__file__).parents[2] / "examples" / "stock_cnn.py"


@pytest.mark.slow
def test_stock_cnn_example_matches_one_device(capsys):
    spec = importlib.util.spec_from_file_location("stock_cnn", PATH)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--steps", "2", "--batch", "16"]) == 0
    out = capsys.readouterr().out
    assert "largest relative difference to one device" in out
