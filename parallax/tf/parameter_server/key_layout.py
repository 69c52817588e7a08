"""How sharded variables map to parameter-server keys: one key per row, shard by shard.

Row ``r`` of a shard that starts at key ``k`` is key ``k + r``, its value the row's
``prod(shape[1:])`` elements. A shard's keys are contiguous on its server, so a request for
whole shards is a few slices on the server, and a request for some rows (an embedding
lookup) names exactly those rows. ``KeyLayout`` turns a list of variables into one sorted
key array for a single request, and cuts the reply back into the variables: loops run over
shards, never over keys.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Shard:
    """One shard of a variable: its rows, the server holding them, and its first key."""

    row_start: int
    rows: int
    server: int
    first_key: int


class KeyLayout:
    """One request's keys for several whole variables, and the way back to their arrays.

    Args:
      variables: objects with ``shape``, ``row_width`` and ``shards`` (``ShardedVariable``).

    Example:
      >>> from types import SimpleNamespace as V
      >>> a = V(shape=(3, 2), row_width=2, shards=(Shard(0, 2, 1, 100), Shard(2, 1, 0, 7)))
      >>> layout = KeyLayout([a])
      >>> layout.keys.tolist(), layout.lens.tolist()
      ([7, 100, 101], [2, 2, 2])
      >>> layout.split(np.arange(6.0))[0].tolist()   # shard 1's row came first
      [[2.0, 3.0], [4.0, 5.0], [0.0, 1.0]]
    """

    def __init__(self, variables):
        self.shapes = [tuple(v.shape) for v in variables]
        pieces = [(shard.first_key, i, shard, v.row_width)
                  for i, v in enumerate(variables) for shard in v.shards]
        pieces.sort(key=lambda piece: piece[0])
        self._pieces = pieces
        self.keys = np.concatenate(
            [np.arange(shard.rows, dtype=np.uint64) + np.uint64(key) for key, _, shard, _ in pieces]
        ) if pieces else np.zeros(0, np.uint64)
        self.lens = np.concatenate(
            [np.full(shard.rows, width, np.int64) for _, _, shard, width in pieces]
        ) if pieces else np.zeros(0, np.int64)
        sizes = [shard.rows * width for _, _, shard, width in pieces]
        self._offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

    def split(self, flat: np.ndarray) -> list[np.ndarray]:
        """The variables' full arrays from a reply in key order."""
        parts: list[list] = [[] for _ in self.shapes]
        for (_, index, shard, width), lo, hi in zip(self._pieces, self._offsets[:-1],
                                                    self._offsets[1:]):
            parts[index].append((shard.row_start, flat[lo:hi].reshape(shard.rows, width)))
        return [np.concatenate([rows for _, rows in sorted(p, key=lambda x: x[0])]).reshape(shape)
                for p, shape in zip(parts, self.shapes)]

    def join(self, arrays) -> np.ndarray:
        """One flat array in key order from the variables' full arrays (e.g. gradients)."""
        rows = [np.asarray(a, np.float32).reshape(-1, width) if a is not None else None
                for a, width in zip(arrays, self._widths())]
        return np.concatenate([
            rows[index][shard.row_start:shard.row_start + shard.rows].reshape(-1)
            for _, index, shard, _ in self._pieces]) if self._pieces else np.zeros(0, np.float32)

    def _widths(self) -> list[int]:
        widths = [1] * len(self.shapes)
        for _, index, _, width in self._pieces:
            widths[index] = width
        return widths
