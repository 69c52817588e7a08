"""How many calls a worker has in flight (made and served), for a graceful shutdown.

``shutdown(graceful=True)`` must not stop a worker while it waits for an answer or runs a
call, nor while another worker may still call it. Each worker counts its calls in flight
and every call it ever started; the driver asks every worker to wait until none is in flight
and repeats until a round in which no worker started a call (``parallax/rpc/group.py``).

References:
  PyTorch, ``torch.distributed.rpc.api._wait_all_workers`` (a barrier of every worker after
  each has waited for its own outstanding work).
"""

from __future__ import annotations

import threading
import time


class Activity:
    """A count of calls in flight and of calls started, with a wait for none in flight.

    Example:
      >>> activity = Activity()
      >>> activity.begin(); activity.in_flight
      1
      >>> activity.end(); activity.wait_idle(deadline=None), activity.started
      (True, 1)
    """

    def __init__(self):
        self._idle = threading.Condition()
        self.in_flight = 0
        self.started = 0

    def begin(self) -> None:
        with self._idle:
            self.in_flight += 1
            self.started += 1

    def end(self) -> None:
        with self._idle:
            self.in_flight -= 1
            if not self.in_flight:
                self._idle.notify_all()

    def wait_idle(self, deadline: float | None) -> bool:
        """Waits until no call is in flight (or ``time.monotonic()`` passes ``deadline``);
        whether none is."""
        with self._idle:
            while self.in_flight:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left)
            return True
