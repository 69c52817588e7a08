"""Helpers for tests that start processes: start one with a deadline (the launcher, a
program), read pids, check none is left."""

from __future__ import annotations

import os
import pathlib
import queue
import re
import subprocess
import sys
import threading
import time

try:
    import process_guard  # under pytest: conftest's directory, tests/, is on the path
except ImportError:  # a launched program that imports a test module (tests/tf/programs)
    from tests import process_guard

PROGRAMS = pathlib.Path(__file__).parent / "programs"
ROOT = pathlib.Path(__file__).parents[2]


def program(name: str) -> str:
    return str(PROGRAMS / name)


def alive(pid: int) -> bool:
    """Running (a zombie waiting for a parent that never reaps it counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def pids_in(text: str) -> list[int]:
    """Every pid a program printed as ``pid P child C``."""
    return [int(p) for pair in re.findall(r"pid (\d+) child (\d+)", text) for p in pair]


def assert_none_left(text: str, expected: int) -> None:
    pids = pids_in(text)
    assert len(pids) == expected, text[-3000:]
    deadline = time.monotonic() + 2
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if alive(p)], f"left running: {[p for p in pids if alive(p)]}"


def test_env(**extra) -> dict:
    """The environment for launched JAX programs: this checkout first on the path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("XLA_FLAGS", None) if "xla_force_host_platform_device_count" in env.get(
        "XLA_FLAGS", "") else None
    env.update(extra)
    return env


TIMED_OUT = object()


class Started:
    """A process a test started (``parallax launch``, a program), read with a deadline.

    Every test that starts a process and reads its output does it through this class.
    Two threads read stdout and stderr as they come; :meth:`lines` yields stdout's lines,
    :meth:`finish` waits for the end. When the deadline passes, or a ``with`` block around
    it ends, the process and everything it started are killed (the launcher's ranks run in
    sessions of their own: tests/process_guard.py walks the tree), and a passed deadline
    raises an AssertionError naming what ran and its last output. It runs in a session of
    its own (a signal for pytest's process group does not reach it) and is registered with
    tests/process_guard.py, which stops it after the test if it still runs.

    Args:
      command: the program and its arguments.
      timeout: seconds from the start to the end of :meth:`finish` (or of :meth:`lines`).
      env: its environment (:func:`test_env` by default).
      cwd: its working directory (the checkout's root by default).
      merge_stderr: stderr goes into stdout (one stream, in order).
    """

    def __init__(self, command: list[str], *, timeout: float = 300, env: dict | None = None,
                 cwd=ROOT, merge_stderr: bool = False):
        self.command, self.timeout = [str(c) for c in command], timeout
        self.deadline = time.monotonic() + timeout
        self.proc = process_guard.register(subprocess.Popen(
            self.command, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
            stdin=subprocess.DEVNULL, text=True, errors="replace", cwd=cwd,
            env=test_env() if env is None else env, start_new_session=True))
        self.out: list[str] = []
        self.err: list[str] = []
        self.fresh: queue.Queue = queue.Queue()  # stdout lines not yet handed out; None: EOF
        self.readers = [threading.Thread(target=self._read, args=(self.proc.stdout, self.out,
                                                                  self.fresh), daemon=True)]
        if not merge_stderr:
            self.readers.append(threading.Thread(target=self._read,
                                                 args=(self.proc.stderr, self.err, None),
                                                 daemon=True))
        for reader in self.readers:
            reader.start()

    @staticmethod
    def _read(pipe, sink: list, fresh) -> None:
        for line in pipe:
            sink.append(line)
            if fresh is not None:
                fresh.put(line)
        if fresh is not None:
            fresh.put(None)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def lines(self):
        """stdout's lines as they come, until the end of the output (or the deadline)."""
        while True:
            try:
                line = self.fresh.get(timeout=max(self.left_s(), 0))
            except queue.Empty:
                line = TIMED_OUT
            if line is TIMED_OUT:
                self._expire("print its output")
            if line is None:
                return
            yield line

    def send_signal(self, number: int) -> None:
        self.proc.send_signal(number)

    def finish(self) -> subprocess.CompletedProcess:
        """Waits for the end (the process and its output); what it printed and its code."""
        try:
            self.proc.wait(timeout=max(self.left_s(), 0))
            ended = True
        except subprocess.TimeoutExpired:
            ended = False
        if not ended:
            self._expire("finish")
        for reader in self.readers:
            reader.join(timeout=max(self.left_s(), 0))
            if reader.is_alive():  # something it started still holds the pipe
                self._expire("close its output")
        return subprocess.CompletedProcess(self.command, self.proc.returncode,
                                           "".join(self.out), "".join(self.err))

    def kill(self) -> list[str]:
        """Kills it and everything below it; what was running, described."""
        killed = process_guard.kill_tree(self.proc.pid) if self.proc.poll() is None else []
        self.proc.wait()
        return killed

    def _expire(self, what: str):
        killed = self.kill()
        for reader in self.readers:
            reader.join(timeout=2)
        raise AssertionError(
            f"{' '.join(self.command)[:300]} did not {what} within {self.timeout} s; killed "
            f"{len(killed)} processes:\n  " + "\n  ".join(killed)
            + f"\n--- its last stdout ---\n{''.join(self.out)[-3000:]}"
            + f"\n--- its last stderr ---\n{''.join(self.err)[-3000:]}")

    def __enter__(self) -> Started:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()


def launcher(args: list[str], *, timeout: float = 300, env: dict | None = None) -> Started:
    """``parallax launch ARGS`` as a separate process (what a user runs), read with a
    deadline (:class:`Started`)."""
    return Started([sys.executable, "-m", "parallax.cli", "launch", *args], timeout=timeout,
                   env=env)


def run_launcher(args: list[str], timeout: float = 300,
                 env: dict | None = None) -> subprocess.CompletedProcess:
    """``parallax launch ARGS`` to its end, or killed with everything it started after
    ``timeout`` seconds (an AssertionError)."""
    return launcher(args, timeout=timeout, env=env).finish()
