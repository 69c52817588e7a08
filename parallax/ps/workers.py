"""Running worker processes against a store: PS-Lite's worker nodes as Ray tasks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray

from parallax.ps.kvstore import KVStore


def run_workers(store: KVStore, fn: Callable[..., Any], *args, num_workers: int | None = None,
                **kwargs) -> list:
    """Runs ``fn(store.worker(rank), *args, **kwargs)`` in one Ray process per rank, at once.

    The workers run concurrently (each is a Ray task asking for no CPU, so a bounded-delay
    store cannot deadlock waiting for a worker that was never scheduled) and are not
    retried: an error in one is raised here.

    Args:
      store: the servers.
      fn: the worker's program; it gets its :class:`parallax.ps.KVWorker` first.
      *args, **kwargs: passed on to ``fn`` (pickled once per worker).
      num_workers: how many ranks to run (default: ``store.num_workers``).

    Returns:
      ``fn``'s results, in rank order.

    Example:
      >>> import numpy as np, parallax as px
      >>> _ = px.ps.init_cluster()
      >>> def count(worker):
      ...     keys = np.array([worker.rank], np.uint64)
      ...     worker.wait(worker.push(keys, np.ones(1, np.float32)))
      ...     return worker.rank
      >>> with px.ps.KVStore(num_workers=2, consistency="eventual") as store:
      ...     px.ps.run_workers(store, count)
      [0, 1]

    References:
      PS-Lite's worker nodes (``ps::StartAsync`` + ``KVWorker``); Ray tasks (Moritz et al.,
      OSDI 2018).
    """
    count = store.num_workers if num_workers is None else num_workers
    if not callable(fn):
        raise TypeError(f"px.ps.run_workers: fn must be callable as fn(worker, ...), got "
                        f"{type(fn).__name__}.")
    if not isinstance(count, int) or not 1 <= count <= store.num_workers:
        raise ValueError(f"px.ps.run_workers: num_workers must be in [1, {store.num_workers}] "
                         f"(the store's num_workers), got {count!r}.")
    remote = ray.remote(num_cpus=0, max_retries=0)(fn)
    refs = [remote.remote(store.worker(rank), *args, **kwargs) for rank in range(count)]
    try:
        return ray.get(refs)
    except ray.exceptions.RayTaskError as error:
        for ref in refs:
            ray.cancel(ref, force=True)
        raise error.cause from None
