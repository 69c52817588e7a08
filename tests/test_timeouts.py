"""A hung test fails alone, with a stack dump, and the run goes on; what a test leaves running
is killed and reported.

Each check runs pytest in a subprocess, on a small test file written here, with this
project's pytest settings (pyproject.toml: pytest-timeout's method, xdist's load groups) and
a timeout of 2 s instead of the default.
"""

import pathlib
import re
import sys
import textwrap

import psutil
import pytest

from tests.distributed.launching import ROOT, Started

HANGS = textwrap.dedent("""
    import subprocess, sys, threading, time
    import pytest

    def waits_for_a_line(proc):
        for line in proc.stdout:  # the program never prints: this never returns
            pass

    def background_work():
        time.sleep(120)

    @pytest.mark.xdist_group("g")
    def test_hangs_reading_a_silent_program():
        threading.Thread(target=background_work, daemon=True).start()
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                                stdout=subprocess.PIPE, text=True)
        try:
            waits_for_a_line(proc)
        finally:
            proc.kill()
            proc.wait()

    @pytest.mark.xdist_group("g")
    def test_after_it_in_its_group():
        pass

    def test_sleeps():
        time.sleep(120)

    def test_quick():
        pass
""")

LEAVES = textwrap.dedent("""
    import subprocess, sys
    from tests.distributed.launching import Started

    def test_leaves_a_process_running():
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)  # LEFT-BEHIND"])

    def test_leaves_a_started_program_running():
        Started([sys.executable, "-c", "import time; time.sleep(120)  # STARTED"])
""")


def run_pytest(tmp_path: pathlib.Path, source: str, *args: str):
    """pytest on ``source`` (written to tmp_path) with this project's settings; the result."""
    (tmp_path / "test_small.py").write_text(source)
    command = [sys.executable, "-m", "pytest", "-c", ROOT / "pyproject.toml", "--rootdir",
               tmp_path, "-p", "no:cacheprovider", "-o", "timeout=2", "--durations=0",
               tmp_path / "test_small.py", *args]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"}
    return Started(command, timeout=120, cwd=tmp_path, env=env, merge_stderr=True).finish()


@pytest.mark.slow
@pytest.mark.parametrize("workers", ["0", "2"])
def test_a_hang_fails_alone_with_a_stack_dump_and_the_run_goes_on(tmp_path, workers):
    done = run_pytest(tmp_path, HANGS, "-n", workers)
    out = done.stdout
    assert done.returncode == 1, out[-4000:]  # tests failed; no crash, no interruption
    assert re.search(r"2 failed, 2 passed in [\d.]+s", out), out[-4000:]
    for name in ("test_hangs_reading_a_silent_program", "test_sleeps"):
        assert re.search(rf"^FAILED \S*::{name}\b", out, re.M), out[-4000:]
    assert out.count("E       Failed: Timeout (>2.0s) from pytest-timeout.") == 2, out[-4000:]
    # where each one hung: the test's own frames ...
    assert "    def waits_for_a_line(proc):\n>       for line in proc.stdout:" in out, out[-4000:]
    assert ">       time.sleep(120)" in out
    # ... and every other thread's stack (pytest-timeout's dump)
    assert re.search(r"~{5,} Stack of .+ ~{5,}", out), out[-4000:]
    assert re.search(r'line \d+, in background_work\n +time\.sleep\(120\)', out), out[-4000:]
    assert "crashed" not in out  # the worker lived on: its group's next test ran
    durations = dict((name, float(seconds)) for seconds, name in re.findall(
        r"^([\d.]+)s call +\S*::(\w+)", out, re.M))
    # the alarm is set just before pytest starts timing the call: 1.99 s was seen
    assert 1.5 < durations["test_sleeps"] < 30, durations


@pytest.mark.slow
@pytest.mark.parametrize("workers", ["0", "2"])  # with workers, the controller reports
def test_a_process_a_test_leaves_is_killed_and_reported(tmp_path, workers):
    done = run_pytest(tmp_path, LEAVES, "-n", workers, "-p", "process_guard")
    out = done.stdout
    assert done.returncode == 1, out[-4000:]  # the first test passed, the session did not
    assert re.search(r"2 passed, 1 error in", out), out[-4000:]
    # what a test started through launching.Started is stopped right after it, naming it
    assert re.search(r"ERROR at teardown of test_leaves_a_started_program_running", out)
    assert re.search(r"this test left processes running \(killed now\):\n +pid \d+: \S+ -c "
                     r"import time; time\.sleep\(120\)  # STARTED", out), out[-4000:]
    # anything else, at the end of the session
    assert re.search(r"processes left running at the end \(killed\)", out), out[-4000:]
    pid = int(re.search(r"pid (\d+): \S+ -c import time; time.sleep\(120\)  # LEFT-BEHIND",
                        out).group(1))
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
