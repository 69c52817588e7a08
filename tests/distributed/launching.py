"""Helpers for tests that start processes: run the launcher, read pids, check none is left."""

import os
import pathlib
import re
import subprocess
import sys
import time

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


def launcher(args: list[str], **popen) -> subprocess.Popen:
    """``parallax launch ARGS`` as a separate process (what a user runs)."""
    return subprocess.Popen([sys.executable, "-m", "parallax.cli", "launch", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env=popen.pop("env", test_env()), **popen)


def run_launcher(args: list[str], timeout: float = 300, **popen) -> subprocess.CompletedProcess:
    proc = launcher(args, **popen)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"the launcher did not finish in {timeout} s:\n{out[-3000:]}\n"
                             f"{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
