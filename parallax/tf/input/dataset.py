"""``px.tf.Dataset``: an input pipeline that a multi-worker job can auto-shard, as tf.data's.

TensorFlow sets the auto-sharding policy on the dataset itself::

    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    dataset = dataset.with_options(options)

and shards it by rewriting the pipeline's graph, which it can because a ``tf.data.Dataset``
knows where its elements come from (its reader and file names). A Python iterable does
not, so parallax asks for the few facts the policies need, as a small immutable pipeline:
where the elements come from (an iterable, or a list of files and a function reading one
file), then ``shard`` and ``batch`` steps, then ``with_options``::

    dataset = (px.tf.Dataset.from_files(files, read_file)      # read_file(f) -> examples
               .batch(global_batch_size)
               .with_options(px.tf.DatasetOptions(auto_shard_policy=px.tf.AutoShardPolicy.DATA)))

Iterating it in one process gives what ``tf.data`` gives (every file, in order, batched);
``MultiWorkerMirroredStrategy.experimental_distribute_dataset`` shards it by its policy
(:mod:`parallax.tf.input.auto_shard`). Elements are pytrees of arrays; ``batch`` stacks ``n`` of
them along a new leading dimension (the last batch shorter unless ``drop_remainder``).
``tensorflow`` is not needed (nor imported): a real ``tf.data.Dataset`` is passed as a plain
iterable (``.as_numpy_iterator()``), with parallax's default split.

References:
  TensorFlow ``tf.data.Options.experimental_distribute`` (``DistributeOptions``),
  ``tf.data.Dataset.with_options``, ``shard``, ``batch``, ``tf.data.experimental.SHARD_HINT``.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Iterator

import jax
import numpy as np

from parallax.tf.input import auto_shard
from parallax.tf.input.auto_shard import SHARD_HINT, AutoShardPolicy


@dataclasses.dataclass(frozen=True)
class DatasetOptions:
    """The distribution options of a :class:`Dataset` (TF's ``DistributeOptions``).

    Attributes:
      auto_shard_policy: an :class:`~parallax.tf.AutoShardPolicy` (default ``AUTO``).

    Example:
      >>> DatasetOptions("data").auto_shard_policy
      <AutoShardPolicy.DATA: 2>

    References:
      TensorFlow, ``tf.data.experimental.DistributeOptions.auto_shard_policy``.
    """

    auto_shard_policy: AutoShardPolicy = AutoShardPolicy.AUTO

    def __post_init__(self):
        policy = self.auto_shard_policy
        if not isinstance(policy, AutoShardPolicy):
            try:
                policy = (AutoShardPolicy[policy.upper()] if isinstance(policy, str)
                          else AutoShardPolicy(policy))
            except (KeyError, ValueError):
                raise ValueError(
                    f"px.tf.DatasetOptions: auto_shard_policy={policy!r} must be one of "
                    f"{[p.name for p in AutoShardPolicy]} (px.tf.AutoShardPolicy).") from None
            object.__setattr__(self, "auto_shard_policy", policy)


def _stack(elements: list):
    return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *elements)


@dataclasses.dataclass(frozen=True)
class Dataset:
    """A pipeline of elements that knows its source, so that workers can shard it.

    Build it with :meth:`from_iterable` or :meth:`from_files`, then :meth:`shard`,
    :meth:`batch` and :meth:`with_options`; each returns a new dataset.

    Example:
      >>> ds = Dataset.from_files(["a", "b", "c"], lambda f: [f + "0", f + "1"]).batch(4)
      >>> [b.tolist() for b in ds]
      [['a0', 'a1', 'b0', 'b1'], ['c0', 'c1']]
      >>> ds.with_options(DatasetOptions(AutoShardPolicy.FILE)).options().auto_shard_policy
      <AutoShardPolicy.FILE: 1>

    References:
      TensorFlow, ``tf.data.Dataset`` (``from_tensor_slices``, ``TFRecordDataset``,
      ``shard``, ``batch``, ``with_options``).
    """

    source: Iterable | None = None
    files: tuple | None = None
    read_file: Callable | None = None
    steps: tuple = ()
    distribute_options: DatasetOptions = DatasetOptions()

    @classmethod
    def from_iterable(cls, elements: Iterable) -> Dataset:
        """Elements from any re-iterable (a list, a loader); AUTO shards it by DATA."""
        if not isinstance(elements, Iterable) or isinstance(elements, Iterator):
            raise TypeError(
                "px.tf.Dataset.from_iterable: elements must be re-iterable (a list, a "
                f"loader; each epoch iterates it afresh), not {type(elements).__name__}.")
        return cls(source=elements)

    @classmethod
    def from_files(cls, files, read_file: Callable) -> Dataset:
        """Elements of ``read_file(f)`` for each file in turn; AUTO shards it by FILE.

        Args:
          files: the file names (or any per-shard keys), in order.
          read_file: ``read_file(f) -> iterable`` of the file's elements (TF's reader).
        """
        if isinstance(files, (str, bytes)) or not isinstance(files, Iterable):
            raise TypeError("px.tf.Dataset.from_files: files must be a list of file names; "
                            f"got {type(files).__name__}.")
        if not callable(read_file):
            raise TypeError("px.tf.Dataset.from_files: read_file must be callable as "
                            f"read_file(file) -> elements; got {type(read_file).__name__}.")
        return cls(files=tuple(files), read_file=read_file)

    def shard(self, num_shards: int, index: int) -> Dataset:
        """Keeps elements ``i % num_shards == index``; ``SHARD_HINT`` for both under HINT."""
        hint = num_shards == SHARD_HINT and index == SHARD_HINT
        if not hint and not (isinstance(num_shards, int) and isinstance(index, int)
                             and 0 <= index < num_shards):
            raise ValueError(
                f"px.tf.Dataset.shard: num_shards={num_shards!r}, index={index!r} must be ints "
                "with 0 <= index < num_shards, or both px.tf.SHARD_HINT (with "
                "AutoShardPolicy.HINT).")
        return dataclasses.replace(self, steps=self.steps + (("shard", num_shards, index),))

    def batch(self, batch_size: int, drop_remainder: bool = False) -> Dataset:
        """Stacks ``batch_size`` consecutive elements (the last batch shorter unless dropped)."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"px.tf.Dataset.batch: batch_size={batch_size!r} must be an "
                             "int >= 1.")
        return dataclasses.replace(
            self, steps=self.steps + (("batch", batch_size, bool(drop_remainder)),))

    def with_options(self, options: DatasetOptions) -> Dataset:
        """The same pipeline with ``options`` (TF's ``dataset.with_options``)."""
        if not isinstance(options, DatasetOptions):
            raise TypeError("px.tf.Dataset.with_options: options must be a "
                            f"px.tf.DatasetOptions; got {type(options).__name__}.")
        return dataclasses.replace(self, distribute_options=options)

    def options(self) -> DatasetOptions:
        """The dataset's options (TF's ``dataset.options()``)."""
        return self.distribute_options

    @property
    def batch_size(self) -> int | None:
        """The size of the last ``batch`` step (the global batch), or None."""
        sizes = [s[1] for s in self.steps if s[0] == "batch"]
        return sizes[-1] if sizes else None

    @property
    def policy(self) -> AutoShardPolicy:
        """The policy that applies (AUTO resolved: FILE for a file-based dataset, else DATA)."""
        return auto_shard.resolve(self.distribute_options.auto_shard_policy,
                                  self.files is not None)

    def __iter__(self) -> Iterator:
        return self.elements_for_worker("px.tf.Dataset", 1, 0)

    def elements_for_worker(self, api: str, num_workers: int, worker: int) -> Iterator:
        """What worker ``worker`` of ``num_workers`` reads under the dataset's policy.

        FILE: its files only; HINT: the ``SHARD_HINT`` steps become ``shard(W, worker)``;
        DATA, OFF: everything (DATA's share of each batch is taken later, by the split).
        """
        policy = self.policy
        if self.files is None:
            elements = iter(self.source)
        else:
            files = (auto_shard.shard_files(api, self.files, num_workers, worker)
                     if policy is AutoShardPolicy.FILE and num_workers > 1 else self.files)
            elements = itertools.chain.from_iterable(self.read_file(f) for f in files)
        for step in self.steps:
            if step[0] == "shard":
                num_shards, index = step[1], step[2]
                if num_shards == SHARD_HINT:
                    if policy is not AutoShardPolicy.HINT:
                        raise ValueError(
                            f"{api}: the dataset has shard(SHARD_HINT, SHARD_HINT) but its "
                            f"auto-shard policy is {policy.name}; the placeholder is only "
                            "replaced under px.tf.AutoShardPolicy.HINT (set it with "
                            "dataset.with_options(px.tf.DatasetOptions(auto_shard_policy="
                            "px.tf.AutoShardPolicy.HINT))).")
                    num_shards, index = num_workers, worker
                elements = auto_shard.shard_elements(elements, num_shards, index)
            else:
                elements = _batched(elements, step[1], step[2])
        return elements


def _batched(elements: Iterator, size: int, drop_remainder: bool) -> Iterator:
    while True:
        chunk = list(itertools.islice(elements, size))
        if not chunk or (drop_remainder and len(chunk) < size):
            return
        yield _stack(chunk)
