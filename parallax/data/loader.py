"""Packed batches on grain: this process's rows of every global batch, resumable exactly.

The rows form one stream that is the same on every process and for any number of
processes: pass 0's rows (documents shuffled with ``seed``, then packed, :mod:`packing`),
then pass 1's (shuffled with the next seed), and so on. Global batch ``k`` is rows
``k * B .. (k + 1) * B - 1`` of that stream; this process reads only its part of them,
``px.distributed.process_slice(B, mesh, strategy)`` (its devices' rows under the strategy's
batch sharding: half of them with two processes splitting the batch, all of them when a
pipeline's stage axis spans the processes), and the train step assembles the global batch
from the processes' parts as for any batch.

So a batch is a function of its index alone, and the iterator's state is that index (plus
the settings and the corpus's fingerprint, checked on resume): saved in ``px.checkpoint``'s
``extra``, it restarts the stream exactly where it stopped, in one process or many, even
under another number of processes. grain runs the pipeline (``MapDataset.range`` of the
batch indices, ``map`` to the rows, ``to_iter_dataset`` with reading threads and prefetch);
the plan of a pass is computed once, from the document lengths, when a batch first needs
it.

The document order is NumPy's legacy ``RandomState([seed, pass])`` permutation, whose
stream NumPy keeps unchanged across versions (a resumed run on another NumPy reads the same
rows). grain's own index shuffle was not used for it: it costs about 30 us a document in
Python (3 s for 100,000), and the plan needs a whole pass's order at once.
"""

from __future__ import annotations

import bisect
import sys
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from parallax.data.corpus import Corpus
from parallax.data.extras import require
from parallax.data.packing import PackedRows, materialize, pack
from parallax.distributed.batches import process_slice

API = "parallax.data.PackedBatches"
KEPT_PLANS = 4  # passes' plans kept (a batch spans at most a few; threads read ahead)
SETTINGS = ("corpus", "seq_len", "global_batch", "seed", "shuffle", "packing", "bins",
            "epochs", "pad_id")


class PackedBatches:
    """Global batches of packed rows (``{"tokens", "segment_ids", "positions"}``, int32
    ``[rows, seq_len + 1]``), of which this process loads its own rows.

    Iterating gives a :class:`PackedIterator` from the first batch (or from a saved state:
    ``it = iter(batches); it.set_state(state)``).

    Args:
      corpus: a :class:`~parallax.data.Corpus`.
      seq_len: T; rows hold ``T + 1`` tokens (``next_token_loss``'s inputs and targets).
      global_batch: rows per global batch (all processes).
      mesh, strategy: the train step's; this process loads
        ``px.distributed.process_slice(global_batch, mesh, strategy)`` of each batch. Without
        them the batch is split evenly over the processes.
      seed: the shuffle's seed (pass ``p`` uses ``[seed, p]``).
      shuffle: shuffle the documents each pass (False: corpus order, e.g. for evaluation).
      packing: ``"whole"`` or ``"split"`` (:mod:`parallax.data.packing`).
      bins: ``"whole"`` packing's open rows.
      epochs: passes over the corpus; None: endless. With a number, the last batch is
        filled up with empty rows (all padding, which no loss counts), so every token is
        read exactly once and every batch has the same shape.
      pad_id: the id of padding tokens (any id in the vocabulary: it is never a counted
        target and never attended to by a real token).
      threads, prefetch: grain's reading threads and batches read ahead (0 threads: read
        in the caller's thread).

    Example:
      >>> from parallax.data import Corpus
      >>> corpus = Corpus.from_documents([[1, 2, 3], [4, 5], [6, 7, 8, 9]])
      >>> batches = PackedBatches(corpus, seq_len=4, global_batch=2, epochs=1, shuffle=False)
      >>> batch = next(iter(batches))
      >>> batch["tokens"].tolist(), batch["segment_ids"].tolist()
      ([[1, 2, 3, 4, 5], [6, 7, 8, 9, 0]], [[1, 1, 1, 2, 2], [1, 1, 1, 1, 0]])
      >>> len(batches)
      1

    References:
      grain (``MapDataset``, ``ReadOptions``); PyTorch ``DistributedSampler`` and grain's
      ``ShardByJaxProcess`` (each process its share); torchtitan's and MaxText's
      checkpointed data iterators.
    """

    def __init__(self, corpus: Corpus, *, seq_len: int, global_batch: int, mesh=None,
                 strategy=None, seed: int = 0, shuffle: bool = True, packing: str = "whole",
                 bins: int = 16, epochs: int | None = None, pad_id: int = 0, threads: int = 2,
                 prefetch: int = 4):
        if not isinstance(corpus, Corpus):
            raise TypeError(f"{API}: corpus must be a parallax.data.Corpus (from "
                            f"parallax.data.tokenize or Corpus.load), got "
                            f"{type(corpus).__name__}.")
        for name, value, least in (("seq_len", seq_len, 1), ("global_batch", global_batch, 1),
                                   ("epochs", 1 if epochs is None else epochs, 1),
                                   ("seed", seed, 0), ("threads", threads, 0),
                                   ("prefetch", prefetch, 0)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
                    or value < least:
                raise ValueError(f"{API}: {name}={value!r} must be an int >= {least}.")
        if corpus.num_tokens == 0:
            raise ValueError(f"{API}: the corpus has no tokens ({corpus!r}); tokenize "
                             "some text first.")
        pack(corpus.lengths[:1], seq_len + 1, method=packing, bins=bins)  # checks the options
        self.corpus, self.seq_len, self.global_batch = corpus, int(seq_len), int(global_batch)
        self.seed, self.shuffle, self.packing, self.bins = int(seed), bool(shuffle), packing, bins
        self.epochs, self.pad_id = epochs, int(pad_id)
        self.threads, self.prefetch = int(threads), int(prefetch)
        self.rows = process_slice(self.global_batch) if mesh is None else process_slice(
            self.global_batch, mesh, strategy)
        self._lock = threading.RLock()  # grain's threads share the plans
        self._plans: dict[int, PackedRows] = {}
        self._ends = [0]  # _ends[p + 1]: rows in passes 0 .. p
        self._length = sys.maxsize if epochs is None else -(-self._rows_before(epochs)
                                                             // self.global_batch)

    def settings(self) -> dict[str, Any]:
        """What a saved state must match to resume (the corpus by its fingerprint)."""
        return {"corpus": self.corpus.fingerprint, "seq_len": self.seq_len,
                "global_batch": self.global_batch, "seed": self.seed, "shuffle": self.shuffle,
                "packing": self.packing, "bins": self.bins, "epochs": self.epochs,
                "pad_id": self.pad_id}

    def plan(self, epoch: int) -> PackedRows:
        """Pass ``epoch``'s rows (computed on first use; the last few used are kept)."""
        with self._lock:
            found = self._plans.pop(epoch, None)
            if found is None:
                d = self.corpus.num_documents
                order = (np.random.RandomState(np.array([self.seed, epoch], np.uint32))
                         .permutation(d) if self.shuffle else np.arange(d))
                found = pack(self.corpus.lengths, self.seq_len + 1, order=order,
                             method=self.packing, bins=self.bins)
            self._plans[epoch] = found  # most recently used last
            while len(self._plans) > KEPT_PLANS:
                del self._plans[next(iter(self._plans))]
            return found

    def _rows_before(self, epoch: int) -> int:
        """Rows in passes ``0 .. epoch - 1``."""
        with self._lock:
            while len(self._ends) <= epoch:
                self._ends.append(self._ends[-1] + self.plan(len(self._ends) - 1).num_rows)
            return self._ends[epoch]

    def epoch_of(self, row: int) -> int:
        """The pass a row of the stream belongs to."""
        with self._lock:
            while self._ends[-1] <= row:
                self._rows_before(len(self._ends))
            return bisect.bisect_right(self._ends, row) - 1

    def local_batch(self, index: int) -> dict[str, np.ndarray]:
        """This process's rows of global batch ``index``."""
        rows = np.arange(index * self.global_batch + self.rows.start,
                         index * self.global_batch + self.rows.stop)
        if self.epochs is not None:
            rows = np.where(rows < self._rows_before(self.epochs), rows, -1)
        parts = []
        for row in rows.tolist():  # consecutive rows: at most a few passes
            epoch = -1 if row < 0 else self.epoch_of(row)
            at = row - self._rows_before(epoch) if row >= 0 else -1
            if parts and parts[-1][0] == epoch:
                parts[-1][1].append(at)
            else:
                parts.append((epoch, [at]))
        batches = [materialize(self.plan(max(epoch, 0)), at, self.corpus.tokens,
                               self.corpus.offsets, self.pad_id) for epoch, at in parts]
        return {key: np.concatenate([b[key] for b in batches]) for key in batches[0]}

    def dataset(self, start: int = 0):
        """The grain ``MapDataset`` of this process's batches from batch ``start`` on."""
        grain = require("grain", API)
        return grain.MapDataset.range(start, self._length).map(self.local_batch)

    def __len__(self) -> int:
        """Global batches in all passes (``epochs`` given); endless otherwise (an error)."""
        if self.epochs is None:
            raise TypeError(f"{API}: endless (epochs=None) has no length; pass epochs=N.")
        return self._length

    def __iter__(self) -> PackedIterator:
        return PackedIterator(self)

    def __repr__(self) -> str:
        return (f"PackedBatches({self.corpus!r}, seq_len={self.seq_len}, global_batch="
                f"{self.global_batch}, rows {self.rows.start}:{self.rows.stop} here, "
                f"packing={self.packing!r}, epochs={self.epochs})")


class PackedIterator(Iterator):
    """Batches from a position, with that position as a state (JSON, for ``extra``).

    Example:
      >>> from parallax.data import Corpus, PackedBatches
      >>> batches = PackedBatches(Corpus.from_documents([[1, 2]] * 8), seq_len=3,
      ...                         global_batch=1, threads=0)
      >>> it = iter(batches); _ = next(it); state = it.get_state()
      >>> again = iter(batches); again.set_state(state)
      >>> bool((next(again)["tokens"] == next(it)["tokens"]).all()), state["next_batch"]
      (True, 1)
    """

    def __init__(self, batches: PackedBatches, start: int = 0):
        self.batches, self.next_batch = batches, start
        self._grain = None

    def _stream(self):
        grain = require("grain", API)
        b = self.batches
        dataset = b.dataset(self.next_batch)
        if b.threads == 0:
            return iter(dataset)
        return iter(dataset.to_iter_dataset(grain.ReadOptions(
            num_threads=b.threads, prefetch_buffer_size=max(b.prefetch, 1))))

    def __next__(self) -> dict[str, np.ndarray]:
        if self.next_batch >= self.batches._length:
            raise StopIteration
        if self._grain is None:
            self._grain = self._stream()
        batch = next(self._grain)
        self.next_batch += 1
        return batch

    @property
    def epoch(self) -> int:
        """The pass of the next batch's first row."""
        return self.batches.epoch_of(self.next_batch * self.batches.global_batch)

    def get_state(self) -> dict[str, Any]:
        """``{"next_batch": k, ...settings}``: JSON values, for ``px.checkpoint.save(...,
        extra={"data": it.get_state()})``; the same on every process."""
        return {"next_batch": self.next_batch, **self.batches.settings()}

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Continues from a saved state; refuses one saved with other settings or data."""
        if not isinstance(state, Mapping) or "next_batch" not in state:
            raise ValueError(f"{API}: set_state takes what get_state returned (a dict with "
                             f"'next_batch'), got {state!r}.")
        mine = self.batches.settings()
        differ = {k: (state.get(k), mine[k]) for k in SETTINGS if state.get(k) != mine[k]}
        if differ:
            lines = "; ".join(f"{k}: saved {a!r}, here {b!r}" for k, (a, b) in differ.items())
            raise ValueError(
                f"{API}: the saved data state does not match this loader ({lines}); resume "
                "with the same corpus and settings (the corpus is compared by fingerprint), "
                "or start the data from batch 0.")
        self.next_batch, self._grain = int(state["next_batch"]), None
