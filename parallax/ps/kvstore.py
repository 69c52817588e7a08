"""``KVStore``: PS-Lite's servers as Ray actors, and the handles workers use to reach them.

How PS-Lite's parts map onto Ray:

| PS-Lite | here |
|---|---|
| scheduler node | Ray's head (GCS + raylet): registers actors, starts processes |
| server node + ``KVServer`` | a :class:`parallax.ps.server.KVServer` Ray actor per key range |
| worker node + ``KVWorker`` | any process holding a :class:`parallax.ps.KVWorker` |
| ``Postoffice`` (node ids, key ranges) | this ``KVStore``: handles, ``server_key_ranges()`` |
| ``Van`` (ZeroMQ messages) | Ray actor calls and its shared-memory object store |
| ``Customer`` (requests in flight) | ``KVWorker``'s timestamp table |
"""

from __future__ import annotations

import pathlib

import numpy as np
import optax
import ray

from parallax.ray_cluster.connect import init_cluster
from parallax.ps.consistency import as_consistency
from parallax.ps.errors import get_from_servers
from parallax.ps.handles import SumHandle
from parallax.ps.keys import MAX_KEY, KeyRange, server_key_ranges
from parallax.ps.optax_handle import OptaxHandle
from parallax.ps.request import is_request_handle
from parallax.ps.server import KVServer, publish_to_object_store
from parallax.ps.worker import KVWorker

_KEEP = object()

# Servers are never restarted by Ray: a fresh server would answer with no values. Their
# death surfaces as ServerUnavailableError, and the run resumes from a checkpoint.
_SERVER_OPTIONS = {"num_cpus": 0, "max_restarts": 0, "max_concurrency": 10_000}


class KVStore:
    """Starts ``num_servers`` parameter servers, each owning one contiguous key range.

    Args:
      num_servers: how many server actors (key ranges).
      handle: what a push does: None for PS-Lite's default (sum), an optax optimizer (the
        server applies it to the pushed gradients), any :class:`parallax.ps.handles.Handle`,
        or a PS-Lite request handle ``handle(meta, data, server)`` that sees every request
        (:mod:`parallax.ps.request`).
      consistency: ``"sequential"``, ``"eventual"`` or ``px.ps.BoundedDelay(tau)``.
      num_workers: how many ranked workers (``store.worker(rank)``) the vector clocks count.
      dtype: the values' dtype.
      max_key: the top of the key space (PS-Lite's ``kMaxKey``).
      value_len: None (each key's length is fixed by its first push), or the number of
        values every key holds: pushes must match it, and a pull of a never-pushed key reads
        that many zeros, as PS-Lite's ``KVServerDefaultHandle`` answers (its keys hold one
        value: ``value_len=1``).

    Example:
      >>> import numpy as np, optax, parallax as px
      >>> _ = px.ps.init_cluster()
      >>> store = px.ps.KVStore(num_servers=1, handle=optax.sgd(0.5))
      >>> worker, keys = store.worker(0), np.arange(3, dtype=np.uint64)
      >>> worker.wait(worker.push(keys, np.ones(3, np.float32), cmd=px.ps.ASSIGN))
      >>> worker.wait(worker.push_pull(keys, np.ones(3, np.float32))).tolist()  # 1 - 0.5 * 1
      [0.5, 0.5, 0.5]
      >>> store.shutdown()

    References:
      Li et al., "Scaling Distributed Machine Learning with the Parameter Server", OSDI 2014;
      PS-Lite (``include/ps/kv_app.h``, ``src/postoffice.cc``).
    """

    def __init__(self, num_servers: int = 1, handle=None, consistency="sequential", *,
                 num_workers: int = 1, dtype=np.float32, max_key: int = MAX_KEY,
                 value_len: int | None = None):
        _check_count("num_servers", num_servers)
        self.value_len = None if value_len is None else _check_count("value_len", value_len)
        _check_count("num_workers", num_workers)
        self.consistency = as_consistency(consistency)
        self.num_workers = num_workers
        self.dtype = np.dtype(dtype)
        self.handle = _as_handle(handle)
        self._ranges = server_key_ranges(num_servers, max_key)
        self._client: KVWorker | None = None
        init_cluster()
        actor = ray.remote(KVServer).options(**_SERVER_OPTIONS)
        self._servers = [
            actor.remote(rank, key_range, self.handle, self.consistency, num_workers, self.dtype,
                         publish_to_object_store)
            for rank, key_range in enumerate(self._ranges)]

    @property
    def num_servers(self) -> int:
        """How many servers (key ranges) the store has."""
        return len(self._servers)

    def server_key_ranges(self) -> tuple[KeyRange, ...]:
        """Each server's key range, in server order (PS-Lite's ``GetServerKeyRanges``)."""
        return self._ranges

    def worker(self, rank: int) -> KVWorker:
        """The ``KVWorker`` of worker ``rank`` (counted by the servers' vector clocks).

        It starts at the iteration the servers have recorded for ``rank`` (0 on a new
        store; where the checkpoint left off after :meth:`restore`).
        """
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)):
            raise TypeError(f"KVStore.worker: rank must be an int, got {type(rank).__name__}.")
        if not 0 <= rank < self.num_workers:
            raise ValueError(f"KVStore.worker: rank {rank} is outside [0, {self.num_workers}); "
                             f"create the store with num_workers={int(rank) + 1} or more.")
        worker = KVWorker(self._servers, self._ranges, rank=int(rank),
                          consistency=self.consistency, dtype=self.dtype,
                          value_len=self.value_len)
        worker.iteration = min(self._get([s.clock_of.remote(int(rank)) for s in self._servers]))
        return worker

    def client(self) -> KVWorker:
        """This process's ``KVWorker`` outside the iteration count (initialisation, reads).

        The same object on every call in a process (its timestamps are its own).
        """
        if (self._client is None or self._client.consistency != self.consistency
                or self._client.value_len != self.value_len):
            self._client = KVWorker(self._servers, self._ranges, rank=None,
                                    consistency=self.consistency, dtype=self.dtype,
                                    value_len=self.value_len)
        return self._client

    def simple_app(self, app_id: int = 0, rank: int = -1):
        """A :class:`parallax.ps.simple_app.SimpleApp` whose server nodes are these servers.

        Args:
          app_id: which app (each has its own request handle on the servers).
          rank: the ``sender`` the servers see (-1: none).
        """
        from parallax.ps.simple_app import SimpleApp

        return SimpleApp(self._servers, self._ranges, int(app_id), int(rank))

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_client"] = None  # each process opens its own
        return state

    def server_pids(self) -> list[int]:
        """The servers' process ids (to watch them, or to kill one in a fault test)."""
        return self._call("ping")

    def stats(self) -> list[dict]:
        """Per server: pushes, pulls, bytes moved, vector clock, and each pull's staleness."""
        return self._call("stats")

    def staleness(self) -> np.ndarray:
        """The staleness of every ranked pull served, all servers together."""
        return np.concatenate([s["staleness"] for s in self.stats()])

    def save(self, directory) -> pathlib.Path:
        """Every server writes its state (values, handle state, clock) with Orbax.

        Each server writes ``<directory>/server-<rank>`` itself (see
        :mod:`parallax.ps.checkpoint`). Each server's snapshot is taken atomically between
        requests; the snapshots of different servers are taken one after the other, so
        pushes arriving meanwhile may be in one server's snapshot and not another's (as
        with any asynchronous store).

        Returns:
          The checkpoint directory.
        """
        directory = pathlib.Path(directory).absolute()
        self._get([server.save.remote(directory) for server in self._servers])
        return directory

    def restore(self, directory) -> None:
        """Loads a :meth:`save` checkpoint into these servers (same number of servers)."""
        directory = pathlib.Path(directory).absolute()
        self._get([server.restore.remote(directory) for server in self._servers])

    def reset(self, *, handle=_KEEP, consistency=_KEEP, num_workers=_KEEP,
              value_len=_KEEP) -> None:
        """Empties every server (keys, handle state, clocks, statistics), keeping the processes.

        Starting server processes is what a store costs (each loads JAX); an experiment
        that compares handles or consistency models on the same servers resets them in
        between. Arguments not given keep their current value. ``KVWorker``s taken before
        the reset belong to the old run: take new ones.
        """
        handle = self.handle if handle is _KEEP else _as_handle(handle)
        consistency = self.consistency if consistency is _KEEP else as_consistency(consistency)
        num_workers = self.num_workers if num_workers is _KEEP else _check_count("num_workers",
                                                                                  num_workers)
        if value_len is not _KEEP:
            self.value_len = None if value_len is None else _check_count("value_len", value_len)
        self._get([server.reset.remote(handle, consistency, num_workers)
                   for server in self._servers])
        self.handle, self.consistency, self.num_workers = handle, consistency, num_workers

    def set_handle(self, handle) -> None:
        """Runs the servers on with another value handle, keeping every stored value.

        The new handle's per-element state starts from its ``init`` of the stored values
        (an optimizer's fresh slots); pushes in flight meet the old or the new handle.
        Request handles keep their own store, so neither side may be one.

        Example:
          >>> import numpy as np, optax, parallax as px
          >>> store = px.ps.KVStore(num_servers=1)                  # sums pushes
          >>> client, keys = store.client(), np.arange(2, dtype=np.uint64)
          >>> client.wait(client.push(keys, np.ones(2, np.float32)))
          >>> store.set_handle(optax.sgd(0.5))                      # now pushes are gradients
          >>> client.wait(client.push(keys, np.ones(2, np.float32)))
          >>> client.wait(client.pull(keys)).tolist()               # 1 - 0.5 * 1
          [0.5, 0.5]
          >>> store.shutdown()
        """
        handle = _as_handle(handle)
        if is_request_handle(handle) or is_request_handle(self.handle):
            raise TypeError("KVStore.set_handle: a request handle keeps its own store, so "
                            "the stored values cannot pass to or from it; use reset(handle=...) "
                            "to start the servers empty with it.")
        self._get([server.set_handle.remote(handle) for server in self._servers])
        self.handle = handle

    def shutdown(self) -> None:
        """Stops the server actors (their values are gone afterwards)."""
        for server in self._servers:
            ray.kill(server, no_restart=True)
        self._servers, self._client = [], None

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _call(self, method: str) -> list:
        return self._get([getattr(server, method).remote() for server in self._servers])

    def _get(self, refs) -> list:
        return get_from_servers(refs, lambda error: (
            f"KVStore: a parameter server's process died ({type(error).__name__}); its "
            f"values are lost. Start a new KVStore and restore a checkpoint "
            f"(KVStore.restore)."))


def _check_count(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"px.ps.KVStore: {name} must be an int, got "
                        f"{type(value).__name__}: {value!r}.")
    if value < 1:
        raise ValueError(f"px.ps.KVStore: {name} must be >= 1, got {value}.")
    return value


def _as_handle(handle):
    if handle is None:
        return SumHandle()
    if isinstance(handle, optax.GradientTransformation):
        return OptaxHandle(handle)
    if callable(getattr(handle, "push", None)) and callable(getattr(handle, "init", None)):
        return handle
    if is_request_handle(handle):
        return handle
    raise TypeError(f"px.ps.KVStore: handle must be None (sum), an optax optimizer, an "
                    f"object with init(values) and push(stored, pushed, state), or a request "
                    f"handle callable as handle(meta, data, server); got "
                    f"{type(handle).__name__}.")
