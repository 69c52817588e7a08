"""benchmarks/pipeline.py runs end to end on its smallest configuration."""

import importlib.util
import pathlib
import re

import pytest

SCRIPT = pathlib.Path(__file__).parents[2] / "benchmarks" / "pipeline.py"


def benchmark():
    spec = importlib.util.spec_from_file_location("pipeline_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_benchmark_prints_a_table_row_and_the_autodiff_row(capsys):
    # every row compiles a program for seconds: one table row and the autodiff row cover both
    # ways a row is printed (the table runtimes are tested in test_runtime.py)
    bench = benchmark()
    assert bench.ROWS == ("gpipe", "1f1b", "1f1b split", "interleaved v=2", "zb_h1", "zb_h2",
                          "interleaved_zb", "zbv", "dualpipev", "gpipe autodiff")
    argv = ["--model", "toy", "--stages", "2", "--microbatches", "2", "--batch", "4",
            "--steps", "1", "--schedules", "1f1b,gpipe autodiff"]
    assert bench.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    at = lines.index(next(line for line in lines if line.startswith("schedule")))
    assert lines[at].split() == ["schedule", "ticks", "bubble", "temp", "MB", "permute", "MB",
                                 "all-reduce", "MB", "flops", "bytes", "time"]
    assert set(lines[at + 1]) == {"-"}
    rows = [line.split() for line in lines[at + 2 : at + 5]]
    assert [row[0] for row in rows] == ["sequential", "1f1b", "gpipe"]
    assert rows[1][1:3] == ["9", "0.333"]  # p = m = 2: 3 (m + p - 1) ticks, (p-1)/(m+p-1)
    assert rows[2][1:4] == ["autodiff", "-", "-"]  # no table to read ticks and bubble from
    assert float(rows[1][6]) >= 1 and float(rows[1][7]) >= 1  # work relative to sequential
    assert lines[at + 5] == ""
    assert "(p - 1) / (m + p - 1) = 0.333" in lines[-1] and "not measured" in lines[-1]


def test_the_benchmark_names_its_rows_when_asked_for_an_unknown_one(capsys):
    with pytest.raises(SystemExit):
        benchmark().main(["--schedules", "1f1b,zb"])
    assert re.search(r"--schedules: unknown 'zb'; use a comma-separated list of: gpipe, 1f1b, "
                     r"1f1b split, interleaved v=2, zb_h1, zb_h2, interleaved_zb, zbv, "
                     r"dualpipev, gpipe autodiff", capsys.readouterr().err)
