"""benchmarks/pipeline.py runs end to end on its smallest configuration."""

import importlib.util
import pathlib
import re

import pytest

from parallax import pipeline as pp

SCRIPT = pathlib.Path(__file__).parents[2] / "benchmarks" / "pipeline.py"


def benchmark():
    spec = importlib.util.spec_from_file_location("pipeline_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_benchmark_prints_a_table_row_and_the_autodiff_row(capsys):
    # every row compiles a program for seconds: one table row that splits the backward
    # (and so the one-device split row) and the autodiff row cover every way a row prints
    bench = benchmark()
    assert bench.ROWS == ("gpipe", "1f1b", "1f1b split", "interleaved v=2", "zb_h1", "zb_h2",
                          "interleaved_zb", "zbv", "dualpipev", "gpipe autodiff")
    argv = ["--model", "toy", "--stages", "2", "--microbatches", "2", "--batch", "4",
            "--steps", "1", "--schedules", "1f1b split,gpipe autodiff"]
    assert bench.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    at = lines.index(next(line for line in lines if line.startswith("schedule")))
    assert lines[at].split() == ["schedule", "ticks", "bubble", "temp", "MB", "permute", "MB",
                                 "all-reduce", "MB", "flops", "bytes", "own", "time"]
    assert set(lines[at + 1]) == {"-"}
    names = ["sequential", "sequential split", "1f1b split", "gpipe autodiff"]
    rows = [line.split() for line in lines[at + 2 : at + 6]]
    assert [" ".join(row[: len(n.split())]) for row, n in zip(rows, names)] == names
    split = pp.schedule("1f1b", 2, 2, split_backward=True)
    assert rows[2][2:4] == [str(split.ticks), f"{split.bubble_fraction():.3f}"]
    assert rows[3][2:4] == ["-", "-"]  # no table to read ticks and bubble from
    flops, nbytes, own = map(float, rows[2][-4:-1])
    assert flops >= 1 and nbytes >= 1 and nbytes > own  # the split costs bytes on its own
    assert float(rows[1][-3]) > 1 and rows[1][-2] == "1.000"  # sequential split's bytes
    assert lines[at + 6] == ""
    assert "(p - 1) / (m + p - 1) = 0.333" in lines[-1] and "not measured" in lines[-1]


def test_the_benchmark_names_its_rows_when_asked_for_an_unknown_one(capsys):
    with pytest.raises(SystemExit):
        benchmark().main(["--schedules", "1f1b,zb"])
    assert re.search(r"--schedules: unknown 'zb'; use a comma-separated list of: gpipe, 1f1b, "
                     r"1f1b split, interleaved v=2, zb_h1, zb_h2, interleaved_zb, zbv, "
                     r"dualpipev, gpipe autodiff", capsys.readouterr().err)
