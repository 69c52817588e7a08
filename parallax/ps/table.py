"""A server's store: sorted keys, each owning a segment of one flat value array.

PS-Lite's default server keeps ``std::unordered_map<Key, Val>``; a Python dict of arrays
would need a loop over keys on every request. Here the keys are one sorted ``uint64`` array,
``offsets[i]:offsets[i + 1]`` is key ``i``'s segment of ``values``, and every lookup,
insertion and gather is a handful of vectorised numpy calls. A request whose keys are
contiguous in the store (a whole variable, or the whole server) becomes a plain slice: no
index array, no copy.
"""

from __future__ import annotations

import numpy as np


def expand_segments(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Flat indices of the segments ``[starts[i], starts[i] + lens[i])``, concatenated.

    Example:
      >>> expand_segments(np.array([10, 3]), np.array([2, 3])).tolist()
      [10, 11, 3, 4, 5]
    """
    lens = np.asarray(lens, np.int64)
    out_starts = np.cumsum(lens) - lens
    return np.repeat(np.asarray(starts, np.int64) - out_starts, lens) + np.arange(
        int(lens.sum()), dtype=np.int64)


class KVTable:
    """Sorted ``uint64`` keys with variable-length values in one flat array.

    Args:
      dtype: the values' dtype.

    Example:
      >>> table = KVTable(np.float32)
      >>> gather = table.insert(np.array([1, 5], np.uint64), np.array([1, 2]))
      >>> table.keys.tolist(), table.offsets.tolist()
      ([1, 5], [0, 1, 3])
      >>> table.elements(table.locate(np.array([5], np.uint64), "demo"))
      slice(1, 3, None)

    References:
      PS-Lite's ``KVServerDefaultHandle`` store (``include/ps/kv_app.h``).
    """

    def __init__(self, dtype):
        self.keys = np.zeros(0, np.uint64)
        self.offsets = np.zeros(1, np.int64)
        self.values = np.zeros(0, dtype)

    @property
    def lens(self) -> np.ndarray:
        """Each key's number of values."""
        return np.diff(self.offsets)

    def find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(position of each key in the store, mask of the keys the store lacks)."""
        positions = np.searchsorted(self.keys, keys)
        found = positions < self.keys.size
        found[found] = self.keys[positions[found]] == keys[found]
        return positions, ~found

    def locate(self, keys: np.ndarray, api: str) -> np.ndarray:
        """Positions of ``keys``, all of which must be stored, else a ``ValueError``."""
        positions, missing = self.find(keys)
        if missing.any():
            raise ValueError(
                f"{api}: {int(missing.sum())} of {keys.size} keys were never pushed to this "
                f"server (first: {keys[missing][0]}), and the pull does not say how many "
                "values they hold. PS-Lite's default handle answers zeros for them: pass "
                "lens= to pull (values per key) or create the KVStore with value_len=k, and "
                "they read as zeros; or push (or assign) a value for a key before pulling it.")
        return positions

    def elements(self, positions: np.ndarray) -> slice | np.ndarray:
        """Where the values of the keys at sorted ``positions`` lie in ``values``."""
        if positions.size == 0:
            return slice(0, 0)
        first, last = int(positions[0]), int(positions[-1])
        if last - first + 1 == positions.size:  # contiguous keys: a view, no index array
            return slice(int(self.offsets[first]), int(self.offsets[last + 1]))
        starts = self.offsets[positions]
        return expand_segments(starts, self.offsets[positions + 1] - starts)

    def insert(self, keys: np.ndarray, lens: np.ndarray) -> np.ndarray:
        """Adds ``keys`` (absent, sorted) with zero values; returns how old elements moved.

        The new ``values`` is ``concatenate([old_values, zeros])[gather]`` for the returned
        ``gather``; per-element state kept alongside the values is re-laid out with it.
        """
        lens = np.asarray(lens, np.int64)
        all_keys = np.concatenate([self.keys, keys])
        all_lens = np.concatenate([self.lens, lens])
        sources = np.concatenate([self.offsets[:-1], self.values.size + np.cumsum(lens) - lens])
        order = np.argsort(all_keys, kind="stable")
        gather = expand_segments(sources[order], all_lens[order])
        self.keys = all_keys[order]
        self.offsets = np.concatenate([[0], np.cumsum(all_lens[order])]).astype(np.int64)
        fresh = np.zeros(int(lens.sum()), self.values.dtype)
        self.values = np.concatenate([self.values, fresh])[gather]
        return gather
