"""Call deadlines of one agent: one watcher thread and a heap, instead of a timer per call.

A ``threading.Timer`` per call starts a thread per call (about 0.1-0.3 ms, most of an RPC's
own overhead on a small payload, measured by ``benchmarks/rpc.py``). Here one daemon thread
sleeps until the earliest deadline; a call that answers in time is skipped when its
deadline comes (its future is done, so expiring it does nothing).

References:
  PyTorch's TensorPipe agent keeps its RPC timeouts in one ordered map served by one
  thread (``timeoutMapCV_``, ``pollTimeoutRpcs``) for the same reason.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable


class Deadlines:
    """Runs ``expire()`` callbacks at their deadlines, from one thread started on first use.

    Example:
      >>> import threading
      >>> fired = threading.Event()
      >>> deadlines = Deadlines()
      >>> deadlines.add(0.01, fired.set)
      >>> fired.wait(5)
      True
      >>> deadlines.close()
    """

    def __init__(self):
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()  # ties: first added, first expired
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def add(self, seconds: float, expire: Callable[[], None]) -> None:
        """Calls ``expire()`` in ``seconds`` (it must be harmless once its call has answered)."""
        with self._wake:
            entry = (time.monotonic() + seconds, next(self._order), expire)
            heapq.heappush(self._heap, entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="parallax-rpc-deadlines",
                                                daemon=True)
                self._thread.start()
            elif self._heap[0] is entry:  # wake the thread only when it must sleep less
                self._wake.notify()

    def close(self) -> None:
        """Stops the thread; deadlines not reached yet never fire."""
        with self._wake:
            self._closed = True
            self._wake.notify()

    def _serve(self) -> None:
        while True:
            with self._wake:
                while not self._closed and (not self._heap or
                                            self._heap[0][0] > time.monotonic()):
                    self._wake.wait(self._heap[0][0] - time.monotonic() if self._heap else None)
                if self._closed:
                    return
                _, _, expire = heapq.heappop(self._heap)
            expire()
