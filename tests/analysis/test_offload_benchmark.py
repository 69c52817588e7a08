"""benchmarks/offload.py runs on CPU (--tiny): three variants, the offloaded ones holding
less device memory, their host bytes and transfers read from the compiled program."""

import importlib.util
import pathlib

import pytest

SCRIPT = pathlib.Path(__file__).parents[2] / "benchmarks" / "offload.py"


def benchmark():
    spec = importlib.util.spec_from_file_location("offload_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_tiny_run_prints_and_appends_three_rows(tmp_path, capsys):
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n\n## Another table\n\n| a |\n|---|\n| 1 |\n\n"
                       "## ZeRO-Offload (benchmarks/offload.py)\n\n| old |\n|---|\n| row |\n\n"
                       "## Notes\n\ntext\n")
    assert benchmark().main(["--tiny", "--results", str(results)]) == 0
    out = capsys.readouterr().out
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in out.splitlines()
            if "| tiny |" in line]
    assert [r[6] for r in rows] == ["-", "optimizer", "params"]
    device, host, moves = ([float(r[i]) for r in rows] for i in (7, 8, 9))
    assert device[0] > device[1] > device[2] and host[0] == 0 < host[1] < host[2]
    assert moves[0] == 0 < moves[1] < moves[2]
    assert all(float(r[11]) > 0 for r in rows)  # tokens/s measured for each
    text = results.read_text()
    section = text.split("## ZeRO-Offload (benchmarks/offload.py)")[1].split("## Notes")[0]
    assert section.count("| tiny |") == 3 and "| row |" in section
    assert "## Another table\n\n| a |\n|---|\n| 1 |\n\n" in text


def test_an_unknown_model_is_named():
    with pytest.raises(SystemExit, match=r"--models: unknown 'gpt9'; use GPTConfig presets"):
        benchmark().main(["--models", "gpt9", "--devices", "2"])
