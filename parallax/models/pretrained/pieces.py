"""Where each of our leaves lies in a checkpoint, and reading only the part a device holds.

A checkpoint stores a matrix ``[rows, cols]`` (or a vector) per tensor, in its own layout:
``torch.nn.Linear`` weights are ``[out, in]``, GPT-2's ``Conv1D`` ``[in, out]``, q/k/v
fused in one matrix. Our leaf is that matrix (transposed if needed), a column range of it
(one of the fused q/k/v), with its rows and columns split into our dimensions (``[D, H*K]``
is our ``[D, H, K]``). :meth:`Piece.read` turns an index into our leaf (what
``jax.make_array_from_callback`` asks for one device) into the smallest rectangle of the
checkpoint's matrix that covers it, reads that rectangle alone, and cuts it to shape.

A leaf of ours that fuses several of the checkpoint's tensors (or column ranges) along an
axis of its own is a :class:`Stacked` of pieces: the fused ``[D, 3, H, K]`` q/k/v kernel is
GPT-2's three column ranges of ``c_attn``, Llama's ``[D, 2, G, K]`` k/v kernel its ``k_proj``
and ``v_proj``, its ``[D, 2, F]`` gate/up kernel ``gate_proj`` and ``up_proj``. Each part is
read with the same index, so a device still reads only its own slice of each.
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
      cols_stored: the same for columns (a padded output head stored ``[V, D]``).
    """

    name: str
    row_dims: tuple[int, ...]
    col_dims: tuple[int, ...]
    transpose: bool = False
    col_offset: int = 0
    rows_stored: int | None = None
    cols_stored: int | None = None

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
        kept_rows, kept_cols = _kept(rows, self.rows_stored), _kept(cols, self.cols_stored)
        index = (kept_cols, kept_rows) if self.transpose else (kept_rows, kept_cols)
        empty = kept_rows.stop == kept_rows.start or kept_cols.stop == kept_cols.start
        block = None if empty else files.read(self.name, index)
        if block is not None and self.transpose:
            block = block.T
        shape = (_count(rows), _count(cols))
        if block is None or block.shape != shape:  # padded rows or columns of ours: zeros
            padded = np.zeros(shape, self._dtype(files, block))
            if block is not None:
                padded[:block.shape[0], :block.shape[1]] = block
            block = padded
        return block

    def _dtype(self, files, block):
        if block is not None:
            return block.dtype
        return files.read(self.name, (slice(0, 1), slice(0, 1))).dtype


@dataclasses.dataclass(frozen=True)
class Stacked:
    """One leaf of ours that stacks several pieces along its dimension ``axis``.

    Attributes:
      parts: the pieces, in the order of the stacked dimension (each of the same shape).
      axis: where the stacked dimension sits in our leaf (without the layers axis).
    """

    parts: tuple[Piece, ...]
    axis: int

    @property
    def shape(self) -> tuple[int, ...]:
        inner = self.parts[0].shape
        return inner[:self.axis] + (len(self.parts),) + inner[self.axis:]

    def read(self, files, index: tuple[slice, ...]) -> np.ndarray:
        """The part ``index`` of our leaf: each selected piece read at the rest of the index.

        Example:
          >>> class Files:                        # q | k | v side by side in one [2, 6]
          ...     def read(self, name, index):
          ...         return np.arange(12.0).reshape(2, 6)[index]
          >>> qkv = Stacked(tuple(Piece("w", (2,), (2,), col_offset=2 * j) for j in range(3)), 1)
          >>> qkv.read(Files(), (slice(0, 1), slice(1, 3), slice(1, 2)))   # k, v of column 1
          array([[[3.],
                  [5.]]])
        """
        index = tuple(slice(*s.indices(n)) for s, n in zip(index, self.shape))
        rest = index[:self.axis] + index[self.axis + 1:]
        chosen = range(*index[self.axis].indices(len(self.parts)))
        return np.stack([self.parts[j].read(files, rest) for j in chosen], axis=self.axis)


def parts_of(piece) -> tuple[Piece, ...]:
    """The checkpoint pieces a leaf reads: itself, or a :class:`Stacked` leaf's parts."""
    return piece.parts if isinstance(piece, Stacked) else (piece,)


def _kept(wanted: slice, stored: int | None) -> slice:
    """The part of ``wanted`` the checkpoint stores (all of it when ``stored`` is None)."""
    if stored is None:
        return wanted
    return slice(min(wanted.start, stored), min(wanted.stop, stored))


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
