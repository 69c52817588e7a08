"""Packing documents into rows of ``T + 1`` tokens, planned from their lengths alone.

A plan (:class:`PackedRows`) says which piece of which document each row holds; it is
computed from the document lengths and an order, without reading a token, so every
process computes the same plan cheaply and then reads only its own rows' tokens
(:func:`materialize`). Each row carries

- ``tokens``: the pieces end to end, then ``pad_id``;
- ``segment_ids``: ``1, 2, ...`` for its pieces in order, ``0`` for padding;
- ``positions``: each token's position in its piece (restarting at 0 with each).

Two methods:

- ``"whole"`` (the default): a document is never cut unless longer than a row (then into
  row-sized pieces first); pieces go into the first of ``bins`` open rows with room
  (first-fit), a row leaves when full or when a piece finds no room among ``bins`` open
  rows (the oldest leaves, padded). Documents stay whole, at the cost of some padding.
- ``"split"``: the documents end to end, cut every ``T + 1`` tokens (no padding but the last
  row's); a document crossing a row boundary becomes two pieces, each trained as a document
  of its own (the second's positions restart at 0).

Every token of the corpus is in exactly one row of a plan (tested).

References:
  Krell et al. 2021, "Efficient Sequence Packing without Cross-contamination" (segment ids,
  restarting positions); grain's ``FirstFitPackIterDataset`` and
  ``ConcatThenSplitIterDataset`` (the two methods, here planned from lengths).
"""

from __future__ import annotations

import dataclasses

import numpy as np

METHODS = ("whole", "split")


@dataclasses.dataclass(frozen=True)
class PackedRows:
    """One pass's rows: row ``r`` holds pieces ``row_starts[r]:row_starts[r + 1]``; piece
    ``p`` is ``length[p]`` tokens of document ``document[p]`` from ``begin[p]``."""

    row_length: int
    row_starts: np.ndarray  # int64 [R + 1]
    document: np.ndarray  # int64 [P]
    begin: np.ndarray  # int64 [P]
    length: np.ndarray  # int64 [P]

    @property
    def num_rows(self) -> int:
        return len(self.row_starts) - 1

    @property
    def fill(self) -> float:
        """The fraction of the rows' slots that hold tokens (1 - padding)."""
        return float(self.length.sum()) / max(1, self.num_rows * self.row_length)


def _check(lengths, row_length, order, method, bins) -> tuple[np.ndarray, np.ndarray]:
    api = "parallax.data.pack"
    if method not in METHODS:
        raise ValueError(f"{api}: method={method!r}; use one of {METHODS} (see the module "
                         "docstring: 'whole' keeps documents whole, 'split' never pads).")
    if isinstance(row_length, bool) or not isinstance(row_length, (int, np.integer)) \
            or row_length < 2:
        raise ValueError(f"{api}: row_length={row_length!r} must be an int >= 2 (T + 1 "
                         "tokens: T inputs and T targets).")
    if isinstance(bins, bool) or not isinstance(bins, (int, np.integer)) or bins < 1:
        raise ValueError(f"{api}: bins={bins!r} must be an int >= 1 (the rows kept open).")
    lengths = np.asarray(lengths, np.int64)
    order = np.arange(len(lengths)) if order is None else np.asarray(order, np.int64)
    if sorted(order.tolist()) != list(range(len(lengths))):
        raise ValueError(f"{api}: order must be a permutation of the {len(lengths)} "
                         "documents' indices.")
    return lengths, order


def _first_fit(lengths, order, row_length: int, bins: int) -> list[list[tuple]]:
    rows, open_rows, room = [], [], []
    for doc in order.tolist():
        for begin in range(0, int(lengths[doc]), row_length):
            n = min(row_length, int(lengths[doc]) - begin)
            piece = (doc, begin, n)
            for i, space in enumerate(room):
                if space >= n:
                    open_rows[i].append(piece)
                    room[i] -= n
                    if room[i] == 0:
                        rows.append(open_rows.pop(i))
                        room.pop(i)
                    break
            else:
                if len(open_rows) == bins:
                    rows.append(open_rows.pop(0))
                    room.pop(0)
                if n == row_length:
                    rows.append([piece])
                else:
                    open_rows.append([piece])
                    room.append(row_length - n)
    return rows + open_rows


def _from_rows(rows: list[list[tuple]], row_length: int) -> PackedRows:
    pieces = [piece for row in rows for piece in row]
    starts = np.zeros(len(rows) + 1, np.int64)
    np.cumsum([len(row) for row in rows], out=starts[1:])
    table = np.asarray(pieces, np.int64).reshape(-1, 3)
    return PackedRows(row_length, starts, table[:, 0], table[:, 1], table[:, 2])


def _split(lengths, order, row_length: int) -> PackedRows:
    ordered = lengths[order]
    keep = ordered > 0
    doc_starts = (np.cumsum(ordered) - ordered)[keep]  # where each document begins
    docs, total = order[keep], int(ordered.sum())
    starts = np.union1d(doc_starts, np.arange(0, total, row_length))
    ends = np.append(starts[1:], total)
    which = np.searchsorted(doc_starts, starts, side="right") - 1
    rows = starts // row_length
    row_starts = np.searchsorted(rows, np.arange(-(-total // row_length) + 1))
    return PackedRows(row_length, row_starts.astype(np.int64), docs[which],
                      starts - doc_starts[which], ends - starts)


def pack(lengths, row_length: int, *, order=None, method: str = "whole",
         bins: int = 16) -> PackedRows:
    """Plans rows of ``row_length`` tokens from the documents' ``lengths``.

    Args:
      lengths: each document's number of tokens (``Corpus.lengths``).
      row_length: ``T + 1``.
      order: the documents in the order to pack (a permutation; None: as given).
      method: ``"whole"`` or ``"split"`` (module docstring).
      bins: ``"whole"``: how many rows stay open for first-fit.

    Returns:
      A :class:`PackedRows`.

    Example:
      >>> plan = pack([3, 2, 4], 5)
      >>> plan.num_rows, plan.document.tolist(), plan.row_starts.tolist()
      (2, [0, 1, 2], [0, 2, 3])
      >>> pack([3, 2, 4], 5, method="split").length.tolist()
      [3, 2, 4]
    """
    lengths, order = _check(lengths, row_length, order, method, bins)
    if method == "split":
        return _split(lengths, order, int(row_length))
    return _from_rows(_first_fit(lengths, order, int(row_length), int(bins)), int(row_length))


def materialize(plan: PackedRows, rows, tokens: np.ndarray, offsets: np.ndarray,
                pad_id: int = 0) -> dict[str, np.ndarray]:
    """The rows ``rows`` of ``plan`` read from the corpus ``tokens`` / ``offsets``.

    A row index of ``-1`` gives an empty row (all padding: what fills a pass's last batch).

    Returns:
      ``{"tokens", "segment_ids", "positions"}``, int32 ``[len(rows), row_length]``.

    Example:
      >>> plan = pack([3, 2], 6)
      >>> out = materialize(plan, [0], np.array([7, 8, 9, 5, 6]), np.array([0, 3, 5]))
      >>> out["tokens"].tolist(), out["segment_ids"].tolist(), out["positions"].tolist()
      ([[7, 8, 9, 5, 6, 0]], [[1, 1, 1, 2, 2, 0]], [[0, 1, 2, 0, 1, 0]])
    """
    rows = np.asarray(rows, np.int64).reshape(-1)
    shape = (len(rows), plan.row_length)
    out = {"tokens": np.full(shape, pad_id, np.int32),
           "segment_ids": np.zeros(shape, np.int32), "positions": np.zeros(shape, np.int32)}
    for i, row in enumerate(rows.tolist()):
        if row < 0:
            continue
        at = 0
        for segment, p in enumerate(range(plan.row_starts[row], plan.row_starts[row + 1]), 1):
            n, start = int(plan.length[p]), int(offsets[plan.document[p]] + plan.begin[p])
            out["tokens"][i, at:at + n] = tokens[start:start + n]
            out["segment_ids"][i, at:at + n] = segment
            out["positions"][i, at:at + n] = np.arange(n)
            at += n
    return out
