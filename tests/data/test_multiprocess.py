"""Two launched processes, each loading only its rows of every packed batch under
FSDP x TP: killed mid-run by pid and resumed, the run is exactly the uninterrupted one."""

import re
import sys

import pytest

from tests.distributed.launching import PROGRAMS, alive, launcher, run_launcher  # noqa: F401

PROGRAM = str(PROGRAMS.parent.parent / "data" / "programs" / "packed_resume.py")
COMMON = ["-np", "2", "--devices-per-process", "2", sys.executable, PROGRAM]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_killed_two_process_run_resumes_to_the_same_batches(tmp_path):
    with launcher([*COMMON, str(tmp_path), "--kill-after", "3"], timeout=400) as first:
        for line in first.lines():
            if re.search(r"saved 3$", line):
                break
        else:
            raise AssertionError("".join(first.out)[-3000:] + "".join(first.err)[-3000:])
        killed = first.kill()  # by pid: the launcher and both ranks
    assert killed and not alive(first.pid)
    done = run_launcher([*COMMON, str(tmp_path), "--resume"], timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for rank, rows in ((0, "[0, 4]"), (1, "[4, 8]")):
        found = re.search(rf"^\[{rank}\] agree (.*)$", done.stdout, re.M)
        assert found, done.stdout[-3000:]
        assert '"resumed_from": 3' in found.group(1) and f'"rows": {rows}' in found.group(1)
