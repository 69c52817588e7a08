"""No test leaves a process running: each test's started processes are stopped after it, and
the session ends with a sweep of whatever this pytest process still has below it.

A process a test starts through ``tests/distributed/launching.py`` (the launcher, a program)
is registered here; after the test, any of them still running is killed with everything it
started (the launcher's ranks run in sessions of their own, so the tree is walked, not one
process group) and the test errors at teardown, naming them. At the end of the session each
process (every pytest-xdist worker, or a lone pytest) kills any descendant still running
and reports it: a worker hands its list to the controller, which prints it and makes the
run fail. Ray's processes are left to the Ray fixture, which checks them itself
(tests/ray_fixtures.py), and multiprocessing's helper processes end with their parent.

conftest.py imports the fixture and the hooks; ``pytest -p process_guard`` loads them into a
pytest run of its own (tests/test_timeouts.py).
"""

from __future__ import annotations

import os
import signal
import subprocess

import psutil
import pytest

# What the tests started through launching.Started, oldest first.
STARTED: list[subprocess.Popen] = []
# The leftovers reported by this process's session, or (the controller) by its workers.
LEFTOVERS: list[str] = []

EXEMPT = ("raylet", "gcs_server", "ray::", "plasma", "dashboard", "log_monitor",
          "/ray/", "multiprocessing.resource_tracker", "multiprocessing.forkserver")


def register(proc: subprocess.Popen) -> subprocess.Popen:
    STARTED.append(proc)
    return proc


def describe(proc: psutil.Process) -> str:
    try:
        return f"pid {proc.pid}: {' '.join(proc.cmdline())[:200]}"
    except psutil.Error:
        return f"pid {proc.pid}"


def running(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def kill_tree(pid: int) -> list[str]:
    """SIGKILLs ``pid``, every process below it and their process groups; what ran, described.

    The tree is read first (a rank's parent is the launcher only while the launcher
    lives), then every process and every process group in it other than pytest's own is
    killed.
    """
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:
        return []
    alive = [p for p in tree if running(p)]
    described = [describe(p) for p in alive]
    groups = set()
    for proc in alive:
        try:
            groups.add(os.getpgid(proc.pid))
        except OSError:
            pass
    for group in groups - {os.getpgrp()}:
        try:
            os.killpg(group, signal.SIGKILL)
        except OSError:
            pass
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)
    return described


def stop_started(since: int) -> list[str]:
    """Kills what was started after ``STARTED[since]`` and still runs (with its tree).

    Only processes not yet reaped are touched: a reaped pid may already be another's.
    """
    left = []
    for proc in STARTED[since:]:
        if proc.poll() is None:
            left += kill_tree(proc.pid)
            proc.wait()
    del STARTED[since:]
    return left


def sweep() -> list[str]:
    """Kills every descendant of this process still running (Ray's and multiprocessing's
    helpers excepted); what ran, described."""
    left = []
    for proc in psutil.Process().children(recursive=False):
        if not running(proc) or _exempt(proc):
            continue
        left += kill_tree(proc.pid)
    return left


def _exempt(proc: psutil.Process) -> bool:
    try:
        text = proc.name() + " " + " ".join(proc.cmdline())
    except psutil.Error:
        return True
    return any(name in text for name in EXEMPT)


@pytest.fixture(autouse=True)
def _processes_of_each_test_are_stopped():
    """After each test, what it started through launching.Started is gone."""
    since = len(STARTED)
    yield
    left = stop_started(since)
    if left:
        pytest.fail("this test left processes running (killed now):\n  " + "\n  ".join(left),
                    pytrace=False)


def _is_controller(config) -> bool:
    """The pytest-xdist controller (its workers sweep their own descendants)."""
    return not hasattr(config, "workerinput") and bool(
        getattr(config.option, "numprocesses", None))


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session):
    if not _is_controller(session.config):
        left = sweep()
        workeroutput = getattr(session.config, "workeroutput", None)
        if workeroutput is not None:
            workeroutput["processes_left"] = left
        LEFTOVERS.extend(left)
    if LEFTOVERS:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    del error
    LEFTOVERS.extend(getattr(node, "workeroutput", {}).get("processes_left", []))


def pytest_terminal_summary(terminalreporter):
    if LEFTOVERS:
        terminalreporter.section("processes left running at the end (killed)", red=True)
        for line in LEFTOVERS:
            terminalreporter.line(line)
