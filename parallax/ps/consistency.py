"""Consistency models of the parameter server (Li et al., OSDI 2014) and their vector clocks.

A worker's *iteration* is what it does between two pushes: pull, compute, push. The push of
iteration ``t`` finishes it. Under ``BoundedDelay(tau)`` a worker may start iteration ``t``
(its pull is answered) only once every worker has finished iteration ``t - tau - 1``:

- ``"sequential"`` is ``BoundedDelay(0)``: each pull sees every worker's previous push (with
  one worker, read-your-writes; with several, bulk-synchronous steps);
- ``"eventual"`` is ``BoundedDelay(inf)``: pulls never wait;
- in between, a worker runs at most ``tau`` iterations ahead of the slowest one.

Each server keeps a :class:`VectorClock` for its key range: how many iterations each worker
has finished there. The *staleness* of a pull at iteration ``t`` is ``t - min(clock)``, the
number of iterations the slowest worker's updates are missing from what it reads; the model
guarantees it never exceeds ``tau``.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class BoundedDelay:
    """A worker may start iteration ``t`` once every worker has finished ``t - tau - 1``.

    Args:
      tau: the allowed delay in iterations (``0`` = sequential, ``math.inf`` = eventual).

    Example:
      >>> BoundedDelay(2).tau, as_consistency("sequential"), as_consistency("eventual").tau
      (2, BoundedDelay(tau=0), inf)

    References:
      Li et al., "Scaling Distributed Machine Learning with the Parameter Server", OSDI 2014,
      section 3.4 (flexible consistency); Ho et al., "More Effective Distributed ML via a
      Stale Synchronous Parallel Parameter Server", NeurIPS 2013.
    """

    tau: float

    def __post_init__(self):
        if isinstance(self.tau, bool) or not isinstance(self.tau, (int, float)):
            raise TypeError(f"px.ps.BoundedDelay: tau must be a number of iterations, got "
                            f"{type(self.tau).__name__}: {self.tau!r}.")
        if self.tau < 0 or (isinstance(self.tau, float) and math.isnan(self.tau)):
            raise ValueError(f"px.ps.BoundedDelay: tau must be >= 0 (0 = sequential, "
                             f"math.inf = eventual), got {self.tau}.")
        if isinstance(self.tau, float) and not math.isinf(self.tau):
            if self.tau != int(self.tau):
                raise ValueError(f"px.ps.BoundedDelay: tau must be a whole number of "
                                 f"iterations, got {self.tau}.")
            object.__setattr__(self, "tau", int(self.tau))

    @property
    def waits(self) -> bool:
        """Whether pulls can ever wait (False for eventual consistency)."""
        return not math.isinf(self.tau)

    def ready(self, iteration: int, slowest: int) -> bool:
        """May a pull at ``iteration`` be answered when the slowest worker finished ``slowest``?"""
        return not self.waits or slowest >= iteration - self.tau


NAMES = {"sequential": BoundedDelay(0), "eventual": BoundedDelay(math.inf)}


def as_consistency(value) -> BoundedDelay:
    """``"sequential"``, ``"eventual"`` or a :class:`BoundedDelay`, as a ``BoundedDelay``.

    Example:
      >>> as_consistency(BoundedDelay(3))
      BoundedDelay(tau=3)
    """
    if isinstance(value, BoundedDelay):
        return value
    if isinstance(value, str) and value in NAMES:
        return NAMES[value]
    raise ValueError(
        f"px.ps: consistency must be 'sequential', 'eventual' or px.ps.BoundedDelay(tau), got "
        f"{value!r}.")


class VectorClock:
    """How many iterations each worker has finished on one key range.

    Pushes may arrive out of order (Ray does not order calls to an asynchronous actor), so a
    worker's clock only advances over a gap-free run of finished iterations; iterations
    finished early wait in a small set until the gap closes.

    Example:
      >>> clock = VectorClock(2)
      >>> clock.finish(0, 1); clock.slowest()   # iteration 1 before 0: no progress yet
      0
      >>> clock.finish(0, 0); clock.finish(1, 0); clock.clock.tolist(), clock.slowest()
      ([2, 1], 1)

    References:
      Li et al., OSDI 2014, section 4.1 (vector clocks per key range).
    """

    def __init__(self, num_workers: int):
        self.clock = np.zeros(num_workers, np.int64)
        self._early: list[set[int]] = [set() for _ in range(num_workers)]

    def finish(self, worker: int, iteration: int) -> None:
        """Records that ``worker`` finished ``iteration`` on this range."""
        if iteration < self.clock[worker]:
            return  # a re-run of a finished iteration (at-least-once delivery)
        early = self._early[worker]
        early.add(iteration)
        while int(self.clock[worker]) in early:
            early.remove(int(self.clock[worker]))
            self.clock[worker] += 1

    def slowest(self) -> int:
        """Iterations finished by every worker."""
        return int(self.clock.min()) if self.clock.size else 0
