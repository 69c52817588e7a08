"""The benchmark runs a small sweep in-process and prints an nccl-tests style table."""

import argparse
import json

from parallax.comm import bench


def test_small_sweep_prints_the_table(tmp_path, capsys):
    out = tmp_path / "comm.json"
    status = bench.main(["-b", "4K", "-e", "4K", "--warmup", "1", "--iters", "1",
                         "--repeats", "1", "--json", str(out)])
    assert status == 0
    text = capsys.readouterr().out
    assert text.startswith("# parallax bench comm: 8 ")
    header = text.splitlines()[1].split()
    assert header == ["#", "size", "count", "type", "op", "algorithm", "time(us)", "algbw",
                      "busbw", "model(us)", "#wrong"]
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert {r["op"] for r in rows} == set(bench.ALGORITHMS)
    assert {(r["op"], r["algorithm"]) for r in rows} == {
        (op, a) for op, algos in bench.ALGORITHMS.items() for a in algos}
    assert all(tuple(r) == bench.COLUMNS for r in rows)
    assert {r["size"] for r in rows} == {4096}
    for r in rows:
        assert r["wrong"] == 0 and r["time_us"] > 0
        factor = {"all_reduce": 2 * 7 / 8, "broadcast": 1.0}.get(r["op"], 7 / 8)
        assert abs(r["busbw"] - r["algbw"] * factor) < 1e-9
        assert abs(r["algbw"] - r["size"] / (r["time_us"] * 1e-6) / 1e9) < 1e-9
    assert len(text.splitlines()) == 3 + len(rows)


def test_json_to_stdout_and_cli_wiring(capsys):
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=8)   # as the parallax CLI does
    bench.add_arguments(parser)                             # must not add it twice
    args = parser.parse_args(["-b", "2K", "-e", "2K", "--ops", "all_reduce", "--algorithms",
                              "ring", "--dtype", "bfloat16", "--compression", "bf16",
                              "--repeats", "1", "--iters", "1", "--json", "-"])
    assert bench.run(args) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["op"], r["algorithm"], r["type"], r["size"]) for r in rows] == [
        ("all_reduce", "ring", "bfloat16", 2048)]


def test_sizes():
    assert bench.message_sizes(1024, 2**20, 4) == [2**10, 2**12, 2**14, 2**16, 2**18, 2**20]
    assert bench.parse_size("64K") == 65536
