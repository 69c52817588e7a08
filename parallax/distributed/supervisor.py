"""One group of launched processes: start them, relay their output, stop them together.

The group shares fate the way a ``jax.distributed`` job does, but quickly: on the first
process that exits non-zero or dies by a signal, the others get SIGTERM, then SIGKILL after a
grace period, and the run ends within seconds, naming the process (not after JAX's heartbeat
timeout). Each process runs in its own session (its own process group), so signals reach its
children too and a terminal's Ctrl-C reaches only the launcher, which forwards it. On Linux
each process also dies with the launcher (``PR_SET_PDEATHSIG``).

(A little over 300 lines: one group's lifecycle, start, relay and stop, whose signal and
exit handling is only correct read together.)
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from parallax.distributed.output import KEEP_LINES, RankOutput

POLL_S = 0.05
SETTLE_S = 0.5  # after a first failure, how long to watch for the rank that caused it

# Lines a process prints when it dies because another one did: it is not the cause.
COLLATERAL = ("Connection closed by peer", "Connection reset by peer",
              "distributed service detected fatal errors", "Polled an error from coordination",
              "Gloo all-reduce failed", "Broken pipe", "Terminating process because")


# Lines of a C++ abort's stack trace: not what a user needs to see first.
NOISE = re.compile(r"^\s*(@\s+0x[0-9a-f]+|\*\*\* Check failure stack trace)")


@dataclasses.dataclass(frozen=True)
class RankExit:
    """How one process ended.

    Example:
      >>> RankExit(rank=1, pid=42, returncode=-9, seconds=3.0).status()
      'was killed by signal SIGKILL (9)'
    """

    rank: int
    pid: int
    returncode: int
    seconds: float
    last_lines: tuple[str, ...] = ()

    @property
    def failed(self) -> bool:
        return self.returncode != 0

    @property
    def collateral(self) -> bool:
        """It died of losing a peer (its last lines say so), not of its own fault."""
        return any(marker in line for line in self.last_lines for marker in COLLATERAL)

    def status(self) -> str:
        """``'exited with code 3'`` or ``'was killed by signal SIGKILL (9)'``."""
        if self.returncode >= 0:
            return f"exited with code {self.returncode}"
        number = -self.returncode
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = f"signal {number}"
        return f"was killed by signal {name} ({number})"

    def shown_lines(self, count: int = 10) -> list[str]:
        """The last lines worth showing: C++ stack frames of an abort are left out."""
        lines = [line for line in self.last_lines
                 if not NOISE.match(line)]
        return lines[-count:]

    def exit_code(self) -> int:
        """The launcher's exit code for this failure: the code, or 128 + the signal."""
        return self.returncode if self.returncode > 0 else 128 - self.returncode


@dataclasses.dataclass(frozen=True)
class GroupResult:
    """How a group ended: every exit seen, the one blamed, whether Ctrl-C stopped it."""

    exits: tuple[RankExit, ...]
    failure: RankExit | None
    interrupted: bool
    pids: tuple[int, ...]
    stopped_for: str | None = None  # why the launcher stopped a healthy group (to resize it)

    @property
    def ok(self) -> bool:
        return self.failure is None and not self.interrupted and self.stopped_for is None


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class ProcessGroup:
    """Starts ``command`` once per environment in ``envs`` and supervises the processes.

    Args:
      command: the program and its arguments.
      envs: one environment per process; ``PARALLAX_PROCESS_ID`` names its rank.
      grace_s: seconds between SIGTERM and SIGKILL when stopping.
      prefix: prefix output lines with the rank.
      gate_rank: the rank that gets the exit-gate pipe (rank 0 on the coordinator's node);
        the pipe closes when every other process of this group has exited.
      log: where the launcher's own messages go.
      commands: one command per process, replacing ``command`` (a rank on another host runs
        through ssh).
    """

    def __init__(self, command: Sequence[str], envs: Sequence[dict], *, grace_s: float = 3.0,
                 prefix: bool = True, gate_rank: int | None = None, log=None,
                 commands: Sequence[Sequence[str]] | None = None):
        self.command, self.envs, self.grace_s = list(command), list(envs), grace_s
        self.commands = [list(c) for c in commands] if commands else [self.command] * len(envs)
        self.prefix, self.gate_rank = prefix, gate_rank
        self.log = log or (lambda text: print(f"parallax launch: {text}", file=sys.stderr,
                                              flush=True))
        self.procs: dict[int, subprocess.Popen] = {}
        self.tails: dict[int, collections.deque] = {}
        self.streams = {}
        self.selector = selectors.DefaultSelector()
        self.gate_writer: int | None = None
        self.interrupt: int | None = None
        self.start_time = 0.0

    def start(self) -> None:
        self.start_time = time.monotonic()
        use_pdeathsig = sys.platform.startswith("linux")
        for env, command in zip(self.envs, self.commands):
            rank = int(env["PARALLAX_PROCESS_ID"])
            env, fds = dict(env), ()
            if rank == self.gate_rank:
                reader, self.gate_writer = os.pipe()
                env["PARALLAX_EXIT_GATE_FD"] = str(reader)
                fds = (reader,)
            proc = subprocess.Popen(
                command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                stdin=subprocess.DEVNULL, start_new_session=True, pass_fds=fds,
                preexec_fn=_die_with_parent if use_pdeathsig else None)
            if fds:
                os.close(fds[0])
            self.procs[rank] = proc
            self.tails[rank] = collections.deque(maxlen=KEEP_LINES)
            for pipe, sink in ((proc.stdout, sys.stdout.buffer), (proc.stderr, sys.stderr.buffer)):
                os.set_blocking(pipe.fileno(), False)
                stream = RankOutput(rank, sink, prefix=self.prefix, tails=self.tails[rank])
                self.streams[pipe.fileno()] = (pipe, stream)
                self.selector.register(pipe, selectors.EVENT_READ, stream)

    def pids(self) -> tuple[int, ...]:
        return tuple(p.pid for p in self.procs.values())

    def _pump(self, timeout: float) -> None:
        for key, _ in self.selector.select(timeout):
            try:
                data = os.read(key.fileobj.fileno(), 65536)
            except BlockingIOError:
                continue
            if data:
                key.data.feed(data)
            else:
                self.selector.unregister(key.fileobj)
                key.data.close()

    def _exit_of(self, rank: int, code: int) -> RankExit:
        return RankExit(rank, self.procs[rank].pid, code, time.monotonic() - self.start_time,
                        tuple(self.tails[rank]))

    def _poll_exits(self, seen: dict[int, RankExit]) -> None:
        for rank, proc in self.procs.items():
            if rank not in seen and (code := proc.poll()) is not None:
                self._pump(0)  # its last lines first
                seen[rank] = self._exit_of(rank, code)
        others = [r for r in self.procs if r != self.gate_rank]
        if self.gate_writer is not None and all(r in seen for r in others):
            os.close(self.gate_writer)  # rank 0 may now take the coordination service down
            self.gate_writer = None

    def run(self, watch=None, watch_every_s: float = 1.0) -> GroupResult:
        """Supervises until every process exited, one failed, or Ctrl-C; then stops the rest.

        ``watch``, if given, is called every ``watch_every_s`` seconds while the group runs;
        a reason it returns (a string) stops the healthy group (SIGTERM, then SIGKILL), as
        an elastic launcher does to start it again with more processes.
        """
        seen: dict[int, RankExit] = {}
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        next_watch = time.monotonic() + watch_every_s
        try:
            while len(seen) < len(self.procs):
                self._pump(POLL_S)
                self._poll_exits(seen)
                if watch is not None and time.monotonic() >= next_watch and not any(
                        e.failed for e in seen.values()) and self.interrupt is None:
                    reason = watch()
                    next_watch = time.monotonic() + watch_every_s
                    if reason:
                        self.log(reason)
                        self._stop(seen)
                        return GroupResult(tuple(seen.values()), None, False, self.pids(),
                                           reason)
                if self.interrupt is not None:
                    self._forward(self.interrupt, seen)
                    self._stop(seen)
                    return GroupResult(tuple(seen.values()), None, True, self.pids())
                if any(e.failed for e in seen.values()):
                    deadline = time.monotonic() + SETTLE_S
                    while time.monotonic() < deadline and len(seen) < len(self.procs):
                        self._pump(POLL_S)
                        self._poll_exits(seen)
                    failure = blame(list(seen.values()))
                    self._stop(seen)
                    return GroupResult(tuple(seen.values()), failure, False, self.pids())
            return GroupResult(tuple(seen.values()), None, False, self.pids())
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            self._drain()
            self._kill_sessions()

    def _on_signal(self, number, frame) -> None:
        del frame
        if self.interrupt is not None:  # a second Ctrl-C: no more grace
            self.grace_s = 0
        self.interrupt = number

    def _forward(self, number: int, seen: dict[int, RankExit]) -> None:
        name = signal.Signals(number).name
        self.log(f"{name} received: forwarding it to ranks "
                 f"{', '.join(str(r) for r in self.procs if r not in seen)}")
        self._signal_running(number, seen)
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline and len(seen) < len(self.procs):
            self._pump(POLL_S)
            self._poll_exits(seen)

    def _signal_running(self, number: int, seen) -> None:
        for rank, proc in self.procs.items():
            if rank not in seen:
                try:
                    os.killpg(proc.pid, number)
                except (ProcessLookupError, PermissionError):
                    pass

    def _stop(self, seen: dict[int, RankExit]) -> None:
        """SIGTERM the processes still running, SIGKILL them after the grace period."""
        for number, wait in ((signal.SIGTERM, self.grace_s), (signal.SIGKILL, 5.0)):
            if len(seen) == len(self.procs):
                return
            self._signal_running(number, seen)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and len(seen) < len(self.procs):
                self._pump(POLL_S)
                self._poll_exits(seen)

    def _drain(self) -> None:
        deadline = time.monotonic() + 1.0
        while self.selector.get_map() and time.monotonic() < deadline:
            self._pump(POLL_S)
        for pipe, stream in self.streams.values():
            stream.close()
            pipe.close()
        self.selector.close()
        if self.gate_writer is not None:
            os.close(self.gate_writer)
            self.gate_writer = None

    def _kill_sessions(self) -> None:
        """Whatever the processes started (their session) goes too: no process is left."""
        for proc in self.procs.values():
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()


def blame(exits: Sequence[RankExit]) -> RankExit | None:
    """The failure that caused the others: the first one that did not die of losing a peer.

    Example:
      >>> first = RankExit(1, 11, 3, 2.0, ("raise SystemExit(3)",))
      >>> victim = RankExit(0, 10, 1, 1.9, ("Gloo all-reduce failed: Connection closed by peer",))
      >>> blame([victim, first]).rank
      1
    """
    failed = sorted((e for e in exits if e.failed), key=lambda e: e.seconds)
    if not failed:
        return None
    causes = [e for e in failed if not e.collateral]
    return (causes or failed)[0]
