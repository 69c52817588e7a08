"""A push and a pull on one server's table, through a value handle (``SumHandle``,
``OptaxHandle``): what PS-Lite's ``KVServerDefaultHandle`` does to its store.

A push of keys never seen inserts them (a key's length is fixed by its first push) and
extends the handle's per-element state (an optimizer's moments) with its initial value;
``UPDATE`` then runs the handle on the stored values and the pushed ones, ``ASSIGN``
overwrites them and resets their state, ``ADD`` adds to them whatever the handle is and
leaves its state alone (TensorFlow's ``assign_add`` next to an optimizer's slots). A pull
reads values, or one per-element slot of the state, in key order; a key never pushed reads
as zeros of the stated length (for a slot: the handle's initial state of zero values),
without being stored.

The functions act on a :class:`~parallax.ps.table.KVTable` in place and take and return the
handle's state; :class:`parallax.ps.server.KVServer` holds both, counts the requests, and
answers the workers.

Example:
  >>> import numpy as np
  >>> from parallax.ps.handles import UPDATE, SumHandle
  >>> table, handle = KVTable(np.float32), SumHandle()
  >>> keys = np.array([3, 9], np.uint64)
  >>> state, error = push(table, handle.init(table.values), handle, keys,
  ...                     np.ones(4, np.float32), None, UPDATE, rank=0)
  >>> values, lens = pull(table, state, handle, np.array([3, 5], np.uint64), None,
  ...                     np.array([2, 1]), rank=0)
  >>> values.tolist(), lens.tolist()                # key 5 was never pushed: zeros
  ([1.0, 1.0, 0.0], [2, 1])

References:
  PS-Lite, ``KVServerDefaultHandle`` (``include/ps/kv_app.h``).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from parallax.ps.handles import ADD, ASSIGN, UPDATE, Handle
from parallax.ps.table import KVTable, expand_segments


def _segments(offsets: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Flat indices of the segments ``offsets[i]:offsets[i + 1]`` of the keys in ``mask``."""
    return expand_segments(offsets[:-1][mask], np.diff(offsets)[mask])


def _is_slot(leaf, values: np.ndarray) -> bool:
    return np.shape(leaf) == values.shape


def pull(table: KVTable, state, handle: Handle, keys, slot, lens, *, rank: int):
    """``(values, lens)`` of ``keys``: the values, or the state's per-element ``slot``.

    ``lens``: the values the caller expects per key (None: whatever is stored); with it a
    key never pushed reads as zeros. The values may be a view of the live table: the
    server publishes a snapshot before the next push lands.
    """
    api = f"KVWorker.pull (server {rank})"
    positions, missing = table.find(keys)
    source = table.values if slot is None else _slot(table, state, handle, slot)
    if missing.any() and lens is None:
        table.locate(keys, api)  # raises, naming the keys and the fix
    stored = positions[~missing]
    stored_lens = table.offsets[stored + 1] - table.offsets[stored]
    if lens is not None:
        lens = np.asarray(lens, np.int64)
        if not np.array_equal(stored_lens, lens[~missing]):
            bad = int(np.argmax(stored_lens != lens[~missing]))
            raise ValueError(f"{api}: key {keys[~missing][bad]} holds {stored_lens[bad]} "
                             f"values but the pull asked for {lens[~missing][bad]} "
                             f"(lens=); pass the length it was pushed with.")
    if missing.any():
        return _with_zeros(table, handle, source, positions, missing, lens, slot), lens
    return source[table.elements(positions)], stored_lens


def _with_zeros(table: KVTable, handle: Handle, source, positions, missing, lens,
                slot) -> np.ndarray:
    """Stored keys' values with never-pushed keys' initial values (zeros) in between.

    Nothing is inserted: PS-Lite's ``store[key]`` would insert the zero, which here
    would fix the key's length and grow the handle's state at a read; a later push
    starts from the same zeros either way.
    """
    out_offsets = np.concatenate([[0], np.cumsum(lens)])
    fresh = np.zeros(int(lens[missing].sum()), table.values.dtype)
    if slot is not None:  # the handle's initial per-element state of zero values
        slots = [leaf for leaf in jax.tree.leaves(handle.init(fresh))
                 if np.shape(leaf) == fresh.shape]
        fresh = np.asarray(slots[slot], source.dtype)
    out = np.empty(int(out_offsets[-1]), source.dtype)
    have = ~missing
    starts = table.offsets[positions[have]]
    out[_segments(out_offsets, have)] = source[expand_segments(starts, lens[have])]
    out[_segments(out_offsets, missing)] = fresh
    return out


def _slot(table: KVTable, state, handle: Handle, slot: int) -> np.ndarray:
    slots = [leaf for leaf in jax.tree.leaves(state) if _is_slot(leaf, table.values)]
    if not 0 <= slot < len(slots):
        raise ValueError(f"KVWorker.pull: slot {slot} does not exist; the handle "
                         f"{handle!r} keeps {len(slots)} per-element slots.")
    return np.asarray(slots[slot])


def push(table: KVTable, state, handle: Handle, keys, values, lens, cmd, *,
         rank: int) -> tuple[Any, Exception | None]:
    """Applies a push; returns ``(state, error)``: the handle's new state, and the
    exception the handle raised (None if it did not; the keys stay inserted then).

    Raises:
      ValueError: an unknown ``cmd``, or a key pushed with another length than its first.
    """
    api = f"KVWorker.push (server {rank})"
    if cmd not in (UPDATE, ASSIGN, ADD):
        raise ValueError(f"{api}: cmd must be px.ps.UPDATE (0), px.ps.ASSIGN (1) or "
                         f"px.ps.ADD (2), got {cmd!r}; other commands need a request handle "
                         f"(handle(meta, data, server), see px.ps.KVMeta).")
    values = np.asarray(values).reshape(-1)
    if lens is None:
        width = values.size // keys.size if keys.size else 0
        lens = np.full(keys.size, width, np.int64)
    positions, missing = table.find(keys)
    if missing.any():
        state = _insert(table, state, handle, keys[missing], np.asarray(lens)[missing])
        positions, _ = table.find(keys)
    stored_lens = table.offsets[positions + 1] - table.offsets[positions]
    if not np.array_equal(stored_lens, lens):
        bad = int(np.argmax(stored_lens != lens))
        raise ValueError(f"{api}: key {keys[bad]} holds {stored_lens[bad]} values on the "
                         f"server but {lens[bad]} were pushed; a key's length is fixed "
                         f"when it is first pushed.")
    if keys.size == 0:
        return state, None  # a clock tick only
    where = table.elements(positions)
    if cmd == ASSIGN:
        table.values[where] = values
        fresh = handle.init(values)
        return _scatter(table, state, where, fresh, shared=False), None
    if cmd == ADD:
        table.values[where] += values.astype(table.values.dtype, copy=False)
        return state, None
    stored = table.values[where]
    part = jax.tree.map(lambda leaf: leaf[where] if _is_slot(leaf, table.values) else leaf,
                        state)
    try:
        new, part = handle.push(stored, values, part)
    except Exception as error:  # noqa: BLE001 - the worker re-raises it, with the server
        return state, error
    if not (isinstance(where, slice) and np.shares_memory(new, table.values)):
        table.values[where] = new
    return _scatter(table, state, where, part, shared=True), None


def _scatter(table: KVTable, state, where, part, *, shared: bool):
    """Writes ``part``'s per-element leaves at ``where``; shared leaves kept or replaced."""
    def put(leaf, new):
        if _is_slot(leaf, table.values):
            leaf = np.array(leaf) if not leaf.flags.writeable else leaf
            leaf[where] = new
            return leaf
        return np.asarray(new) if shared else leaf
    return jax.tree.map(put, state, part)


def rehandle(table: KVTable, handle: Handle):
    """A new handle's state for the values already stored (they are kept): an optimizer
    given after the variables exist starts with fresh slots, as TensorFlow's creates them
    at its first ``apply_gradients``."""
    return handle.init(table.values)


def _insert(table: KVTable, state, handle: Handle, keys, lens):
    """Inserts ``keys`` (``lens`` values each, zeros) and their initial per-element state."""
    old_size = table.values.size
    old_values = table.values
    gather = table.insert(keys, lens)
    fresh = handle.init(np.zeros(table.values.size - old_size, old_values.dtype))

    def merge(leaf, new):
        if np.shape(leaf) == old_values.shape:
            return np.concatenate([np.asarray(leaf), np.asarray(new)])[gather]
        return leaf
    if old_size == 0:
        return handle.init(table.values)
    return jax.tree.map(merge, state, fresh)
