"""One parameter server: a key range's store, its handle, and its vector clock.

``KVServer`` is a plain class with ``async`` methods; :class:`parallax.ps.KVStore` runs each
one as a Ray actor (an asynchronous actor, so a pull waiting for its consistency condition
does not block the pushes that will satisfy it). A request runs to completion between two
``await`` points, so every push is applied atomically and every pull reads one version.
What a push and a pull do to the table through a value handle is
:mod:`parallax.ps.table_updates`; a request handle (``handle(meta, data, server)``) answers
here.
"""

from __future__ import annotations

import asyncio
import os
import traceback
from typing import Any

import jax
import numpy as np
import ray

from parallax.ps.checkpoint import load_snapshot, save_snapshot, server_path
from parallax.ps.consistency import BoundedDelay, VectorClock
from parallax.ps.handles import UPDATE, Handle
from parallax.ps.keys import KeyRange
from parallax.ps import table_updates
from parallax.ps.request import HandleFailure, KVMeta, KVPairs, is_request_handle
from parallax.ps.table import KVTable


def publish_to_object_store(array: np.ndarray, min_bytes: int = 1 << 20):
    """A snapshot of ``array`` for a reply: large ones go to Ray's object store right away.

    Ray serialises an actor's return value after the request's coroutine has finished, when
    a later push may have changed the store in place; ``ray.put`` inside the request copies
    the bytes once, at the right moment. The caller gets the ``ObjectRef`` and fetches it.
    """
    if array.nbytes >= min_bytes:
        return ray.put(array)
    return np.array(array)


class KVServer:
    """Stores one key range's values and answers pushes and pulls (PS-Lite's ``KVServer``).

    Args:
      rank: this server's index.
      key_range: the keys it owns.
      handle: what a push does (:class:`parallax.ps.SumHandle`, :class:`parallax.ps.OptaxHandle`).
      consistency: when a pull may be answered.
      num_workers: how many ranked workers the vector clock tracks.
      dtype: the values' dtype.
      publish: turns a pulled array into what the request returns (the actor puts large
        arrays in Ray's object store from inside the request, so the reply is a snapshot).

    Example:
      >>> import asyncio
      >>> from parallax.ps import SumHandle, as_consistency
      >>> server = KVServer(0, KeyRange(0, 100), SumHandle(), as_consistency("eventual"), 1,
      ...                   np.float32)
      >>> keys = np.array([3, 9], np.uint64)
      >>> asyncio.run(server.push(keys, np.ones(4, np.float32), None, 0, None, 0))
      >>> values, lens, staleness = asyncio.run(server.pull(keys, None, None, 0))
      >>> values.tolist(), lens.tolist()
      ([1.0, 1.0, 1.0, 1.0], [2, 2])

    References:
      PS-Lite, ``KVServer`` and ``KVServerDefaultHandle`` (``include/ps/kv_app.h``); Li et
      al., OSDI 2014, sections 3.4 and 4.1.
    """

    def __init__(self, rank: int, key_range: KeyRange, handle: Handle,
                 consistency: BoundedDelay, num_workers: int, dtype, publish=None):
        self.rank, self.key_range = rank, key_range
        self.publish = publish or np.array
        self._changed = asyncio.Condition()
        self._simple_handles: dict[int, Any] = {}  # SimpleApp id -> request handle
        self._start(handle, consistency, num_workers, dtype)

    def _start(self, handle, consistency, num_workers, dtype) -> None:
        self.handle, self.consistency = handle, consistency
        self.table = KVTable(dtype)
        self.state: Any = None if is_request_handle(handle) else handle.init(self.table.values)
        self._response: KVPairs | None = None
        self.clock = VectorClock(num_workers)
        self._staleness: list[int] = []
        self._counts = {"pushes": 0, "pulls": 0, "bytes_pushed": 0, "bytes_pulled": 0}

    async def reset(self, handle, consistency, num_workers) -> None:
        """Forgets every key, clock and statistic; runs on with a new handle and model."""
        self._start(handle, consistency, num_workers, self.table.values.dtype)

    async def set_handle(self, handle) -> None:
        """Runs on with ``handle``, keeping the stored values (its state starts fresh)."""
        self.handle, self.state = handle, table_updates.rehandle(self.table, handle)

    # -- requests --------------------------------------------------------------------------

    async def push(self, keys, values, lens, cmd, worker, iteration, timestamp=-1):
        """Applies a push and ticks ``worker``'s clock (also when the handle fails).

        Returns None, or a :class:`~parallax.ps.request.HandleFailure` when the handle
        raised (the worker raises it once every server has answered).
        """
        try:
            if is_request_handle(self.handle):
                meta = self._meta(cmd, True, False, worker, timestamp)
                failure = self._call_handle("push", meta, KVPairs(keys, values, lens))[1]
            else:
                failure = self._apply(keys, values, lens, cmd)
        finally:
            if worker is not None:
                self.clock.finish(worker, iteration)
                async with self._changed:
                    self._changed.notify_all()
        return failure

    async def pull(self, keys, slot, worker, iteration, lens=None, cmd=UPDATE, timestamp=-1):
        """(values, lens, staleness) of ``keys`` once the consistency model allows it.

        ``lens``: the values expected per key (None: what is stored); a key never pushed
        reads as that many zeros (PS-Lite's ``store[key]`` of a missing key), unstored.
        A request handle answers instead (``cmd``, ``timestamp`` in its ``KVMeta``).
        """
        staleness = await self._admit(worker, iteration)
        if is_request_handle(self.handle):
            meta = self._meta(cmd, False, True, worker, timestamp)
            data = KVPairs(keys, np.zeros(0, self.table.values.dtype), lens)
            return self._answer("pull", meta, data, lens, staleness)
        return self._read(keys, slot, lens) + (staleness,)

    async def push_pull(self, keys, values, lens, cmd, worker, iteration, timestamp=-1):
        """A push then, in the next iteration, a pull of the same keys (one round trip).

        A request handle sees one request with ``meta.push`` and ``meta.pull`` both set
        (PS-Lite's ``PushPull``).
        """
        if is_request_handle(self.handle):
            try:
                meta = self._meta(cmd, True, True, worker, timestamp)
                return self._answer("push_pull", meta, KVPairs(keys, values, lens), None, None)
            finally:
                if worker is not None:
                    self.clock.finish(worker, iteration)
                    async with self._changed:
                        self._changed.notify_all()
        failure = await self.push(keys, values, lens, cmd, worker, iteration, timestamp)
        if failure is not None:
            return failure
        return await self.pull(keys, None, worker, None if worker is None else iteration + 1)

    async def set_simple_handle(self, app_id: int, handle) -> None:
        """Sets the request handle of SimpleApp ``app_id`` (:mod:`parallax.ps.simple_app`)."""
        self._simple_handles[app_id] = handle

    async def simple(self, app_id: int, request):
        """Runs SimpleApp ``app_id``'s request handle: the reply, or a HandleFailure."""
        from parallax.ps.simple_app import SimpleData, default_request_handle

        replies = []
        server = self

        class Responder:  # what the handle's ``app`` argument offers: response()
            rank, key_range = server.rank, server.key_range

            @staticmethod
            def response(req, body: str = "") -> None:
                replies.append(SimpleData(req.head, str(body), server.rank, req.timestamp))

        handle = self._simple_handles.get(app_id, default_request_handle)
        try:
            handle(request, Responder())
        except Exception as error:  # noqa: BLE001 - the app re-raises it, with the server
            return self._failure(f"SimpleApp.request (head={request.head})", error)
        return replies[0] if replies else SimpleData(request.head, "", self.rank,
                                                     request.timestamp)

    def response(self, meta: KVMeta, data: KVPairs | None = None) -> None:
        """Answers the request ``meta`` with ``data`` (PS-Lite's ``KVServer::Response``).

        For a request handle; returning the ``KVPairs`` from the handle does the same.
        """
        del meta  # one request runs at a time: the answer belongs to the current one
        self._response = KVPairs(np.zeros(0, np.uint64), np.zeros(0)) if data is None else data

    def _meta(self, cmd, push, pull, worker, timestamp) -> KVMeta:
        return KVMeta(cmd=int(cmd), push=push, pull=pull,
                      sender=-1 if worker is None else int(worker),
                      timestamp=-1 if timestamp is None else int(timestamp))

    def _failure(self, api: str, error: BaseException) -> HandleFailure:
        trace = "".join(traceback.format_exception(error))
        try:
            ray.cloudpickle.dumps(error)
        except Exception:  # noqa: BLE001 - an exception that cannot travel: send its text
            error = RuntimeError(f"{type(error).__name__}: {error}")
        return HandleFailure(self.rank, self.key_range.begin, self.key_range.end, api, error,
                             trace)

    def _call_handle(self, api, meta, data):
        """(the handle's answer, None) or (None, HandleFailure) for one request."""
        self._response = None
        try:
            answer = self.handle(meta, data, self)
        except Exception as error:  # noqa: BLE001 - the worker re-raises it, with the server
            return None, self._failure(f"KVWorker.{api} (cmd={meta.cmd})", error)
        return (answer if answer is not None else self._response), None

    def _answer(self, api, meta, data, lens, staleness):
        """A request handle's pull answer as (values, lens, staleness), or a HandleFailure."""
        answer, failure = self._call_handle(api, meta, data)
        if failure is not None:
            return failure
        try:
            if not isinstance(answer, KVPairs):
                raise TypeError(f"a request handle must answer a pull with px.ps.KVPairs "
                                f"(returned, or passed to server.response), got "
                                f"{type(answer).__name__}")
            values = np.asarray(answer.vals, self.table.values.dtype).reshape(-1)
            got = answer.key_lens() if data.keys.size else np.zeros(0, np.int64)
            if not np.array_equal(np.asarray(answer.keys, np.uint64), data.keys) or \
                    int(got.sum()) != values.size:
                raise ValueError(f"the answer's keys {np.asarray(answer.keys).tolist()} must be "
                                 f"the requested keys {data.keys.tolist()}, with lens adding "
                                 f"up to its {values.size} values")
        except (TypeError, ValueError) as error:
            return self._failure(f"KVWorker.{api} (cmd={meta.cmd})", error)
        self._counts["pulls"] += 1
        self._counts["bytes_pulled"] += values.nbytes
        return self.publish(values), got, staleness

    async def ping(self) -> int:
        return os.getpid()  # this server's process id (also a liveness check)

    async def clock_of(self, worker: int) -> int:
        return int(self.clock.clock[worker])  # iterations it finished on this key range

    async def stats(self) -> dict:
        """Request counts, bytes moved, and the staleness of every ranked pull served."""
        return dict(self._counts, staleness=np.asarray(self._staleness, np.int64),
                    clock=self.clock.clock.copy(), keys=int(self.table.keys.size),
                    values=int(self.table.values.size))

    async def snapshot(self) -> dict:
        """The whole server state as arrays (keys, offsets, values, handle state, clock)."""
        return {"keys": self.table.keys.copy(), "offsets": self.table.offsets.copy(),
                "values": self.table.values.copy(),
                "state": [np.array(leaf) for leaf in jax.tree.leaves(self.state)],
                "clock": self.clock.clock.copy()}

    async def save(self, directory) -> str:
        """Writes this server's snapshot under ``directory`` (Orbax, in a thread)."""
        snapshot = await self.snapshot()  # taken between requests: one consistent version
        path = server_path(directory, self.rank)
        await asyncio.to_thread(save_snapshot, path, snapshot)
        return str(path)

    async def restore(self, directory) -> None:
        """Replaces this server's state with its shard of the checkpoint in ``directory``."""
        snapshot = await asyncio.to_thread(load_snapshot, server_path(directory, self.rank))
        await self.load(snapshot)

    async def load(self, snapshot: dict) -> None:
        """Replaces the server state with a :meth:`snapshot` (restoring a checkpoint)."""
        self.table.keys = np.asarray(snapshot["keys"], np.uint64)
        self.table.offsets = np.asarray(snapshot["offsets"], np.int64)
        self.table.values = np.array(snapshot["values"], self.table.values.dtype)
        if not is_request_handle(self.handle):
            treedef = jax.tree.structure(self.handle.init(self.table.values))
            self.state = jax.tree.unflatten(treedef, [np.array(x) for x in snapshot["state"]])
        self.clock.clock[:] = np.asarray(snapshot["clock"])

    # -- internals ---------------------------------------------------------------------------

    async def _admit(self, worker, iteration) -> int | None:
        if worker is None:
            return None
        if self.consistency.waits:
            async with self._changed:
                await self._changed.wait_for(
                    lambda: self.consistency.ready(iteration, self.clock.slowest()))
        staleness = iteration - self.clock.slowest()
        self._staleness.append(staleness)
        return staleness

    def _read(self, keys, slot, lens=None):
        values, lens = table_updates.pull(self.table, self.state, self.handle, keys, slot, lens,
                                          rank=self.rank)
        self._counts["pulls"] += 1
        self._counts["bytes_pulled"] += values.nbytes
        # A slice is a view of the live store: publish a snapshot before the next push lands.
        return self.publish(values), lens

    def _apply(self, keys, values, lens, cmd) -> HandleFailure | None:
        self.state, error = table_updates.push(self.table, self.state, self.handle, keys, values,
                                               lens, cmd, rank=self.rank)
        self._counts["pushes"] += 1
        self._counts["bytes_pushed"] += np.asarray(values).nbytes
        return None if error is None else self._failure(f"KVWorker.push (cmd={cmd})", error)
