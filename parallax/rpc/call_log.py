"""An optional record of the calls workers make: caller, callee, what, start and end times.

Off by default (nothing is recorded and nothing is paid). ``record_calls()``, opened on the
process that called ``init_rpc``, turns it on in every worker of the group; on exit it
collects every worker's calls into the list it yielded, sorted by start time. A call is
recorded by its *caller*, from the moment it is sent to the moment its answer arrives
(``time.time()``, comparable across the processes of one machine). Calls that RPC makes
for its own bookkeeping (RRef forks and fetches, autograd backward, optimizer steps) are
recorded too, each with its kind (``fork``, ``fetch``, ``backward``, ``register_optimizer``,
``optimizer_step``); RRef releases and context releases are one-way messages, not calls,
and are not recorded. One recording at a time (``record_calls`` blocks do not nest).

Example:
  >>> import parallax.rpc as rpc
  >>> from parallax.rpc.call_log import record_calls
  >>> rpc.init_rpc("main")
  >>> with record_calls() as calls:
  ...     rpc.rpc_sync("main", max, args=(1, 2))
  2
  >>> [(c.caller, c.callee, c.kind, c.what) for c in calls]
  [('main', 'main', 'run', 'rpc_sync(max)')]
  >>> rpc.shutdown()

References:
  PyTorch, ``torch.distributed.rpc`` profiling (``torch.autograd.profiler`` records RPC
  calls per worker); this is a much smaller record for sequence diagrams.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import NamedTuple

from parallax.rpc.agent import current_agent


class CallRecord(NamedTuple):
    """One call: who made it, to whom, its kind (``run`` for a user's function), what it ran
    (``rpc_sync(fn)``, ``remote(fn)``, ...), and when it was sent and answered (seconds)."""

    caller: str
    callee: str
    kind: str
    what: str
    start: float
    end: float


class CallLog:
    """The calls one agent made while recording was on (thread-safe)."""

    def __init__(self):
        self._records: list[CallRecord] = []
        self._lock = threading.Lock()

    def start(self, caller: str, callee: str, kind: str, describe: str, args: tuple,
              future, sent: float | None = None) -> None:
        """Records the call behind ``future`` (``WorkerState.<kind>(*args)``) once it settles;
        ``sent``: the ``time.time()`` it was sent at (now if None)."""
        future._on_settled(lambda _: self.add(caller, callee, kind, describe, args, sent))

    def add(self, caller: str, callee: str, kind: str, describe: str, args: tuple,
            sent: float | None) -> None:
        """Records a call that has just answered (``sent``: when it left; now if None)."""
        what = describe.split(" on worker ")[0]
        if kind == "run" and "(_call_method)" in what:  # an RRef proxy's call: name the method
            what = what.replace("(_call_method)", f"(.{args[1][1]})")
        ended = time.time()
        with self._lock:
            self._records.append(CallRecord(caller, callee, kind, what,
                                            ended if sent is None else sent, ended))

    def take(self) -> list[CallRecord]:
        with self._lock:
            records, self._records = self._records, []
        return records


def start_recording() -> None:
    """Turns recording on in this worker (``record_calls`` does it in every worker)."""
    agent = current_agent("call_log.start_recording")
    if agent.call_log is None:
        agent.call_log = CallLog()


def stop_recording() -> list[CallRecord]:
    """Turns recording off in this worker; returns what it recorded."""
    agent = current_agent("call_log.stop_recording")
    log, agent.call_log = agent.call_log, None
    return log.take() if log is not None else []


@contextlib.contextmanager
def record_calls() -> Iterator[list[CallRecord]]:
    """Records every worker's calls in the body; yields a list, filled on exit (by start)."""
    agent = current_agent("call_log.record_calls")
    if agent.in_actor:
        raise RuntimeError(f"parallax.rpc.call_log.record_calls: worker {agent.name!r} is a "
                           "worker actor; open record_calls on the process that called init_rpc "
                           "(it turns recording on in every worker)")
    if agent.call_log is not None:
        raise RuntimeError("parallax.rpc.call_log.record_calls: calls are already being "
                           "recorded here; record_calls blocks do not nest (use one block)")
    others = [name for name in agent.names if name in agent.peers and name != agent.name]
    for name in others:
        agent.call_and_wait(name, "run", (start_recording, (), {}, None, None, None),
                            timeout=None, describe="start_recording")
    start_recording()
    records: list[CallRecord] = []
    try:
        yield records
    finally:
        collected = stop_recording()
        for name in others:
            collected += agent.call_and_wait(name, "run", (stop_recording, (), {}, None, None,
                                                           None), timeout=None,
                                             describe="stop_recording")
        records.extend(sorted(collected, key=lambda record: record.start))
