"""``parallax launch`` from the command line in torchrun's spellings: a bare ``train.py`` runs
with the launcher's Python, ``-m`` runs a module, abbreviations are not guessed."""

import json
import re
import sys

import pytest

from parallax import cli
from tests.distributed import launching
from tests.distributed.launching import ROOT

pytestmark = pytest.mark.multiprocess

SCRIPT = "tests/distributed/programs/rank_env.py"


def reports(out):
    return [json.loads(line.partition("env ")[2]) for line in out.splitlines()
            if re.match(r"\[\d+\] env \{", line)]


@pytest.mark.slow
def test_a_bare_script_runs_with_this_python():
    # what a user types, as a separate process: torchrun's line with `parallax launch`
    done = launching.run_launcher(["--nproc-per-node", "2", SCRIPT, "--lr", "1"], timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = reports(done.stdout)
    assert sorted(r["RANK"] for r in seen) == ["0", "1"]
    assert {(r["python"], tuple(r["argv"]), r["WORLD_SIZE"]) for r in seen} == {
        (sys.executable, ("--lr", "1"), "2")}


def test_a_module_and_no_abbreviations(capfd, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert cli.main(["launch", "--nproc_per_node", "2", "-m",
                     "tests.distributed.programs.rank_env", "--x"]) == 0
    out, err = capfd.readouterr()
    assert sorted(tuple(r["argv"]) for r in reports(out)) == [("--x",), ("--x",)], err
    with pytest.raises(SystemExit):
        cli.main(["launch", "--nproc-per", "2", sys.executable])
    assert "unrecognized arguments: --nproc-per" in capfd.readouterr().err
