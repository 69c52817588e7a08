"""``KVWorker``: push, pull and wait, with PS-Lite's timestamps.

A request is sliced by key range and sent to every server it touches at once (one Ray actor
call each); it returns a timestamp at once, and :meth:`KVWorker.wait` blocks until every
server has answered, returning the pulled values in key order. The table of requests in
flight is PS-Lite's ``Customer``; Ray's actor calls and object store are its ``Van``.

(Over 300 lines: one class, PS-Lite's ``KVWorker``, whose push, pull, push_pull and wait
share the slicing by key range and the one table of requests in flight; about half of it is
the docstrings and examples of that public API.)
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable

import numpy as np
import ray

from parallax.ps.consistency import BoundedDelay
from parallax.ps.errors import get_from_servers, raise_handle_failures
from parallax.ps.handles import UPDATE
from parallax.ps.keys import KeyRange, check_keys, value_offsets
from parallax.ps.request import HandleFailure
from parallax.ps.slicer import Slicer, checked_bounds, default_slicer


@dataclasses.dataclass
class _Request:
    """One request in flight: which servers were asked, and their replies' refs."""

    pull: bool
    servers: list[int]
    refs: list
    done: concurrent.futures.Future | None = None  # set when a callback was given


class KVWorker:
    """A worker's (or the driver's) connection to the servers: PS-Lite's ``KVWorker``.

    Get one from :meth:`parallax.ps.KVStore.worker` (a ranked worker, counted by the vector
    clocks) or :meth:`parallax.ps.KVStore.client` (no rank: reads and writes outside the
    iteration count). A ``KVWorker`` pickles, so it can be handed to a Ray task or actor;
    requests in flight stay behind.

    Each :meth:`push` of a ranked worker ends one *iteration*: under
    ``BoundedDelay(tau)`` its next :meth:`pull` is answered only when every worker has
    finished ``iteration - tau``. Pulled arrays are read-only views of Ray's object store.

    Example:
      >>> import numpy as np, parallax as px
      >>> _ = px.ps.init_cluster()  # a local Ray cluster on 127.0.0.1 (no-op if one runs)
      >>> with px.ps.KVStore(num_servers=1) as store:
      ...     worker = store.worker(0)
      ...     keys = np.array([7, 2**63 + 1], np.uint64)          # sorted uint64 keys
      ...     stamp = worker.push(keys, np.array([1.0, 2.0], np.float32))  # returns at once
      ...     worker.wait(stamp)                                   # acknowledged
      ...     worker.wait(worker.pull(keys)).tolist()
      [1.0, 2.0]

    References:
      PS-Lite, ``KVWorker::Push``/``Pull``/``Wait`` (``include/ps/kv_app.h``); Li et al.,
      OSDI 2014.
    """

    def __init__(self, servers: list, ranges: tuple[KeyRange, ...], *, rank: int | None,
                 consistency: BoundedDelay, dtype, value_len: int | None = None):
        self._servers = list(servers)
        self.value_len = value_len
        self._ranges = tuple(ranges)
        self.rank = rank
        self.consistency = consistency
        self.dtype = np.dtype(dtype)
        self.iteration = 0
        self.staleness: list[int] = []
        self.bytes_pulled = 0
        self._next_timestamp = 0
        self._pending: dict[int, _Request] = {}
        self._slicer: Slicer = default_slicer
        self._callbacks: concurrent.futures.ThreadPoolExecutor | None = None

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_pending"] = {}  # replies belong to the process that asked
        state["_callbacks"] = None  # each process runs its own callback thread
        return state

    def set_slicer(self, slicer: Slicer) -> None:
        """Sets how requests' keys are split over the servers (PS-Lite's ``set_slicer``).

        Args:
          slicer: ``slicer(keys, ranges) -> parts``, one entry per server: the increasing
            positions into ``keys`` that server gets, or None. Each request's parts are
            checked: a key sent to a server whose range does not hold it, to two servers, or
            to none, is an error naming the key. See :mod:`parallax.ps.slicer`.

        Example:
          >>> import numpy as np, parallax as px
          >>> from parallax.ps.slicer import default_slicer
          >>> _ = px.ps.init_cluster()
          >>> with px.ps.KVStore(num_servers=2, max_key=100) as store:
          ...     worker = store.client()
          ...     worker.set_slicer(lambda keys, ranges: default_slicer(keys, ranges))
          ...     worker.wait(worker.push(np.array([1, 70], np.uint64), np.ones(2, np.float32)))
          ...     worker.wait(worker.pull(np.array([1, 70], np.uint64))).tolist()
          [1.0, 1.0]

        References:
          PS-Lite, ``KVWorker::set_slicer`` and ``DefaultSlicer`` (``include/ps/kv_app.h``).
        """
        if not callable(slicer):
            raise TypeError(f"KVWorker.set_slicer: the slicer must be callable as "
                            f"slicer(keys, ranges) -> one part per server; got "
                            f"{type(slicer).__name__}.")
        self._slicer = slicer

    # -- requests --------------------------------------------------------------------------

    def push(self, keys, values, lens=None, cmd: int = UPDATE,
             cb: Callable[[], None] | None = None) -> int:
        """Sends ``values`` for sorted ``keys`` to their servers; returns a timestamp.

        Args:
          keys: sorted, unique uint64 keys.
          values: the values, flat in key order (or ``[len(keys), k]``).
          lens: values per key, when keys have different lengths.
          cmd: ``px.ps.UPDATE`` (the server's handle), ``px.ps.ASSIGN`` (overwrite) or
            ``px.ps.ADD`` (add, whatever the handle); a request handle
            (:mod:`parallax.ps.request`) receives any integer.
          cb: called as ``cb()`` once every server has applied the push: on this worker's
            callback thread, in the order requests were issued, before :meth:`wait` of
            this request returns (PS-Lite's ``Push(..., cmd, cb)``).

        Returns:
          The request's timestamp, for :meth:`wait`.
        """
        _check_cb("KVWorker.push", cb)
        keys, values, offsets, bounds = self._prepare("KVWorker.push", keys, values, lens)
        self._check_value_len("KVWorker.push", keys, offsets)
        tick = self.rank is not None and self.consistency.waits  # every server's clock moves
        request, timestamp = _Request(pull=False, servers=[], refs=[]), self._next_timestamp
        for server, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            if lo == hi and not tick:
                continue
            piece_lens = None if lens is None else np.asarray(lens)[lo:hi]
            request.servers.append(server)
            request.refs.append(self._servers[server].push.remote(
                keys[lo:hi], values[offsets[lo]:offsets[hi]], piece_lens, cmd, self.rank,
                self.iteration, timestamp))
        if self.rank is not None:
            self.iteration += 1
        return self._track(request, cb)

    def pull(self, keys, slot: int | None = None, lens=None, *, cmd: int = UPDATE,
             cb: Callable[[np.ndarray], None] | None = None) -> int:
        """Asks for the values of sorted ``keys``; returns a timestamp for :meth:`wait`.

        Args:
          keys: sorted, unique uint64 keys.
          slot: None for the values; ``i`` for the handle's ``i``-th per-element state
            (an optimizer's moments).
          lens: how many values each key holds: an int for every key, or one per key;
            default: the store's ``value_len``, else whatever the servers hold. A key never
            pushed reads as that many zeros (for a slot: the handle's initial state of zero
            values), PS-Lite's default-handle answer (``store[key]`` of a missing key is a
            zero); it is not stored. Without a length a never-pushed key is an error.
          cmd: passed to a request handle in its ``KVMeta`` (ignored by simple handles).
          cb: called as ``cb(values)`` with the pulled values once every server has
            answered: on this worker's callback thread, in the order requests were issued,
            before :meth:`wait` of this request returns (PS-Lite's ``Pull(..., cb)``).

        Example:
          >>> import numpy as np, parallax as px
          >>> _ = px.ps.init_cluster()
          >>> with px.ps.KVStore(num_servers=1) as store:
          ...     client = store.client()
          ...     client.wait(client.push(np.array([3], np.uint64), np.ones(2, np.float32)))
          ...     client.wait(client.pull(np.array([3, 8], np.uint64), lens=2)).tolist()
          [1.0, 1.0, 0.0, 0.0]

        References:
          PS-Lite, ``KVWorker::Pull`` and ``KVServerDefaultHandle``
          (``include/ps/kv_app.h``).
        """
        _check_cb("KVWorker.pull", cb)
        keys = check_keys("KVWorker.pull", keys)
        lens = self._pull_lens(keys, lens)
        bounds = checked_bounds("KVWorker.pull", self._slicer, keys, self._ranges)
        request = _Request(pull=True, servers=[], refs=[])
        for server, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            if lo < hi:
                request.servers.append(server)
                request.refs.append(self._servers[server].pull.remote(
                    keys[lo:hi], slot, self.rank, self.iteration,
                    None if lens is None else lens[lo:hi], cmd, self._next_timestamp))
        return self._track(request, cb)

    def _pull_lens(self, keys: np.ndarray, lens) -> np.ndarray | None:
        """``lens`` as one length per key (the store's ``value_len`` by default), or None."""
        if lens is None:
            lens = self.value_len
        if lens is None:
            return None
        if isinstance(lens, (int, np.integer)) and not isinstance(lens, bool):
            lens = np.full(keys.size, lens, np.int64)
        array = np.asarray(lens)
        if (array.shape != keys.shape or (array.size and not np.issubdtype(array.dtype,
                                                                           np.integer))
                or (array.size and array.min() < 0)):
            raise ValueError(f"KVWorker.pull: lens must be a non-negative int or one per key "
                             f"({keys.size} keys); got {lens!r}.")
        return array.astype(np.int64)

    def _check_value_len(self, api: str, keys: np.ndarray, offsets: np.ndarray) -> None:
        if self.value_len is None or keys.size == 0:
            return
        lens = np.diff(offsets)
        if (lens != self.value_len).any():
            bad = int(np.argmax(lens != self.value_len))
            raise ValueError(f"{api}: key {keys[bad]} gets {lens[bad]} values, but the store "
                             f"was created with value_len={self.value_len} (every key holds "
                             f"that many); push {self.value_len} values per key.")

    def push_pull(self, keys, values, lens=None, cmd: int = UPDATE,
                  cb: Callable[[np.ndarray], None] | None = None) -> int:
        """A push, then a pull of the same keys answered after it (one round trip each server).

        Returns:
          A timestamp; :meth:`wait` returns the values after the push (and after whatever
          the consistency model makes the pull wait for). ``cb`` is called as
          ``cb(values)``, as for :meth:`pull`.
        """
        _check_cb("KVWorker.push_pull", cb)
        keys, values, offsets, bounds = self._prepare("KVWorker.push_pull", keys, values, lens)
        self._check_value_len("KVWorker.push_pull", keys, offsets)
        request = _Request(pull=True, servers=[], refs=[])
        for server, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            if lo == hi:
                if self.rank is not None and self.consistency.waits:
                    self._servers[server].push.remote(keys[lo:hi], values[:0], None, cmd,
                                                      self.rank, self.iteration)
                continue
            piece_lens = None if lens is None else np.asarray(lens)[lo:hi]
            request.servers.append(server)
            request.refs.append(self._servers[server].push_pull.remote(
                keys[lo:hi], values[offsets[lo]:offsets[hi]], piece_lens, cmd, self.rank,
                self.iteration, self._next_timestamp))
        if self.rank is not None:
            self.iteration += 1
        return self._track(request, cb)

    def wait(self, timestamp: int, *, with_lens: bool = False):
        """Blocks until the request ``timestamp`` is answered by every server it went to.

        Args:
          timestamp: what :meth:`push`, :meth:`pull` or :meth:`push_pull` returned.
          with_lens: also return each key's number of values.

        Returns:
          None for a push; for a pull, the values in key order (flat), or
          ``(values, lens)`` with ``with_lens``. Waiting again for a finished request
          returns None at once (pulled values are handed out once).

        Raises:
          ServerUnavailableError: a server of the request died.
          HandleError: a server's handle raised (the other servers' parts were applied);
            also whatever the request's callback raised.
        """
        request = self._pending.pop(timestamp, None)
        if request is None:
            if isinstance(timestamp, int) and 0 <= timestamp < self._next_timestamp:
                return None  # already waited for (PS-Lite's Wait is idempotent too)
            raise ValueError(f"KVWorker.wait: timestamp {timestamp!r} was never issued by this "
                             f"worker (it has issued 0..{self._next_timestamp - 1}).")
        if request.done is not None:
            flat, lens = request.done.result()
        else:
            flat, lens = self._collect(request)
        if flat is None:
            return None
        return (flat, lens) if with_lens else flat

    def _collect(self, request: _Request):
        """(values, lens) of a finished request ((None, None) for a push), or its error."""
        replies = self._get(request.refs, request.servers)
        failures = [reply for reply in replies if isinstance(reply, HandleFailure)]
        raise_handle_failures("KVWorker.wait", failures, len(self._servers))
        if not request.pull:
            return None, None
        inner = [i for i, reply in enumerate(replies) if isinstance(reply[0], ray.ObjectRef)]
        fetched = self._get([replies[i][0] for i in inner], [request.servers[i] for i in inner])
        values = [reply[0] for reply in replies]
        for i, array in zip(inner, fetched):
            values[i] = array
        lens = [reply[1] for reply in replies]
        staleness = [reply[2] for reply in replies if reply[2] is not None]
        if staleness:
            self.staleness.append(max(staleness))
        flat = values[0] if len(values) == 1 else (
            np.concatenate(values) if values else np.zeros(0, self.dtype))
        self.bytes_pulled += flat.nbytes
        return flat, (lens[0] if len(lens) == 1 else np.concatenate(lens) if lens
                      else np.zeros(0, np.int64))

    # -- internals ---------------------------------------------------------------------------

    def _prepare(self, api, keys, values, lens):
        keys = check_keys(api, keys)
        values = np.asarray(values)
        if values.dtype != self.dtype:
            if not np.can_cast(values.dtype, self.dtype, "same_kind"):
                raise TypeError(f"{api}: the store holds {self.dtype} values, got "
                                f"{values.dtype}; cast them (values.astype({self.dtype.name})).")
            values = values.astype(self.dtype)
        values = values.reshape(-1)
        offsets = value_offsets(api, keys, values, lens)
        return keys, values, offsets, checked_bounds(api, self._slicer, keys, self._ranges)

    def _track(self, request: _Request, cb=None) -> int:
        timestamp = self._next_timestamp
        self._next_timestamp += 1
        self._pending[timestamp] = request
        if cb is not None:
            if self._callbacks is None:  # one thread: callbacks run in issue order
                self._callbacks = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="parallax-ps-callbacks")
            request.done = self._callbacks.submit(self._complete, request, cb)
        return timestamp

    def _complete(self, request: _Request, cb):
        """Runs on the callback thread: waits for the replies, then calls ``cb``."""
        flat, lens = self._collect(request)
        if request.pull:
            cb(flat)
        else:
            cb()
        return flat, lens

    def _get(self, refs, servers):
        def unavailable(error):
            dead = _dead_server(refs, servers)
            where = ("" if dead is None else
                     f" server {dead} of {len(self._servers)} (keys [{self._ranges[dead].begin}, "
                     f"{self._ranges[dead].end})):")
            return (f"KVWorker.wait: a parameter server is unreachable;{where} its process died "
                    f"({type(error).__name__}) and its values are lost. Restart the servers and "
                    f"restore them from a checkpoint (KVStore.save / KVStore.restore).")

        return get_from_servers(refs, unavailable)


def _dead_server(refs, servers) -> int | None:
    """Which of the asked servers failed (None if none can be singled out)."""
    for ref, server in zip(refs, servers):
        try:
            ray.get(ref, timeout=0)
        except ray.exceptions.RayActorError:
            return server
        except Exception:  # noqa: BLE001 - only the dead server matters here
            continue
    return None


def _check_cb(api: str, cb) -> None:
    if cb is not None and not callable(cb):
        raise TypeError(f"{api}: cb must be callable (cb() for a push, cb(values) for a pull), "
                        f"got {type(cb).__name__}.")
