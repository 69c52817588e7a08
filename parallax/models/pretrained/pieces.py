"""Where each of our leaves lies in a checkpoint, and reading only the part a device holds.

A checkpoint stores a matrix ``[rows, cols]`` (or a vector) per tensor, in its own layout:
``torch.nn.Linear`` weights are ``[out, in]``, GPT-2's ``Conv1D`` ``[in, out]``, q/k/v
fused in one matrix. Our leaf is that matrix (transposed if needed), a column range of it
(one of the fused q/k/v), with its rows and columns split into our dimensions (``[D, H*K]``
is our ``[D, H, K]``). :meth:`Piece.read` turns an index into our leaf (what
``jax.make_array_from_callback`` asks for one device) into the smallest rectangle of the
checkpoint's matrix that covers it, reads that rectangle alone, and cuts it to shape.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class Piece:
    """One leaf of ours (without the stacked layers axis) in one checkpoint tensor.

    Attributes:
      name: the checkpoint tensor's name.
      row_dims: our leading dimensions, which split the matrix's rows (``()`` for a vector).
      col_dims: our trailing dimensions, which split the (selected) columns.
      transpose: the checkpoint stores ``[cols, rows]`` (``torch.nn.Linear``'s ``[out, in]``).
      col_offset: the first column of ours in the checkpoint's matrix (fused q/k/v).
      rows_stored: rows the checkpoint has when ours has more (vocabulary padding: the rest
        are zero); None when equal.
    """

    name: str
    row_dims: tuple[int, ...]
    col_dims: tuple[int, ...]
    transpose: bool = False
    col_offset: int = 0
    rows_stored: int | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.row_dims + self.col_dims

    def read(self, files, index: tuple[slice, ...]) -> np.ndarray:
        """The part ``index`` of our leaf, reading only the rectangle that covers it.

        Example:
          >>> class Files:                       # a checkpoint holding one [4, 6] matrix
          ...     def read(self, name, index):
          ...         return np.arange(24.0).reshape(4, 6)[index]
          >>> piece = Piece("w", (4,), (2, 3))   # ours [4, 2, 3]: the columns split 2 x 3
          >>> piece.read(Files(), (slice(1, 2), slice(1, 2), slice(0, 3)))
          array([[[ 9., 10., 11.]]])
        """
        index = tuple(slice(*s.indices(n)) for s, n in zip(index, self.shape))
        rows_at, cols_at = index[:len(self.row_dims)], index[len(self.row_dims):]
        row_range, row_inner = _covering(rows_at, self.row_dims)
        col_range, col_inner = _covering(cols_at, self.col_dims)
        col_range = slice(col_range.start + self.col_offset, col_range.stop + self.col_offset)
        block = self._rectangle(files, row_range, col_range)
        rows_shape = (_count(rows_at[0]),) + self.row_dims[1:] if self.row_dims else ()
        block = block.reshape(rows_shape + (_count(cols_at[0]),) + self.col_dims[1:])
        return block[row_inner + col_inner]

    def _rectangle(self, files, rows: slice | None, cols: slice) -> np.ndarray:
        if rows is None:  # a vector
            return files.read(self.name, (cols,))
        stored = self.rows_stored
        kept = rows if stored is None else slice(min(rows.start, stored), min(rows.stop, stored))
        index = (cols, kept) if self.transpose else (kept, cols)
        block = files.read(self.name, index) if kept.stop > kept.start else None
        if block is not None and self.transpose:
            block = block.T
        missing = (rows.stop - rows.start) - (kept.stop - kept.start)
        if missing:  # padded rows of ours: zeros
            pad = np.zeros((missing, cols.stop - cols.start), self._dtype(files, block))
            block = pad if block is None else np.concatenate([block, pad])
        return block

    def _dtype(self, files, block):
        return block.dtype if block is not None else files.read(self.name, (slice(0, 1),)).dtype


def _count(s: slice) -> int:
    return s.stop - s.start


def _covering(index: tuple[slice, ...], dims: tuple[int, ...]):
    """The range along the flattened ``dims`` that covers ``index``, and the slices that then
    cut the read block (the outer dimension's shifted to start at 0)."""
    if not dims:
        return None, ()
    inner = math.prod(dims[1:])
    first = index[0]
    flat = slice(first.start * inner, first.stop * inner)
    return flat, (slice(0, first.stop - first.start),) + tuple(index[1:])
