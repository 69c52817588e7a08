"""Auto-sharding across workers: TensorFlow's ``AutoShardPolicy`` as pure assignment rules.

When ``MultiWorkerMirroredStrategy.experimental_distribute_dataset`` gets a dataset, each of
the ``W`` workers builds its own copy of the pipeline, and TensorFlow rewrites the copies so
that the workers read different data (``input_lib.py`` ``_create_cloned_datasets_from_dataset``
rebatches the global batches ``G`` into ``N = W * R`` mini-batches, then
``input_ops.auto_shard_dataset`` and the ``tf_auto_shard`` graph rewrite shard the copy):

* ``FILE``: a shard op is put before the reader: worker ``k`` reads files ``k, k+W, ...``,
  batches *its* elements by ``G`` and rebatches each batch into ``N`` mini-batches of sizes
  ``worker_batch_sizes(G, W, R, k)``; each step its ``R`` replicas take the next ``R`` of
  them, so a step consumes about ``G / W`` rows per worker and ``G`` in all. Fewer files than
  workers is an error (``ShardDataset`` with ``require_non_empty``).
* ``DATA``: every worker reads every element; the rebatch becomes the legacy one (each
  global batch of ``p`` rows cut into ``N`` mini-batches of ``ceil(p / N)`` rows, the last
  ones shorter or empty) and a shard op at the end keeps mini-batches ``i`` with
  ``i % W == k``: replica ``r`` of worker ``k`` gets mini-batch ``k + r * W`` of each global
  batch. Each step is one global batch, as on one worker.
* ``AUTO`` (TF's default): ``FILE`` when the dataset is read from files, else ``DATA``.
* ``OFF``: no shard: every worker reads everything (rebatched as under ``FILE``).
* ``HINT``: ``dataset.shard(SHARD_HINT, SHARD_HINT)`` placeholders become
  ``shard(W, k)``; nothing else is sharded.

The functions here compute those assignments; :mod:`parallax.tf.input.dataset` carries the
policy on a dataset and :mod:`parallax.tf.input.workers` feeds the replicas by it.

References:
  TensorFlow ``tensorflow/python/data/experimental/ops/distribute.py`` (``_AutoShardDataset``,
  ``batch_sizes_for_worker``, ``_LegacyRebatchDataset``), ``data/ops/options.py``
  (``AutoShardPolicy``), ``core/grappler/optimizers/data/auto_shard.cc``,
  ``core/kernels/data/shard_dataset_op.cc`` (the too-few-files error),
  ``distribute/input_lib.py``; the guide "Distributed input", section "Sharding".
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

SHARD_HINT = -1  # TF's tf.data.experimental.SHARD_HINT: "replace me by the worker count"


class AutoShardPolicy(enum.IntEnum):
    """How a multi-worker job splits a dataset over the workers (TF's values).

    Members:
      OFF: every worker reads everything.
      AUTO: FILE when the dataset is read from files, else DATA (the default).
      FILE: worker ``k`` of ``W`` reads files ``k, k+W, ...``.
      DATA: every worker reads everything and keeps its share of each global batch.
      HINT: replace ``shard(SHARD_HINT, SHARD_HINT)`` placeholders by ``shard(W, k)``.

    Example:
      >>> AutoShardPolicy.DATA, AutoShardPolicy(-1)
      (<AutoShardPolicy.DATA: 2>, <AutoShardPolicy.OFF: -1>)

    References:
      TensorFlow, ``tf.data.experimental.AutoShardPolicy``.
    """

    OFF = -1
    AUTO = 0
    FILE = 1
    DATA = 2
    HINT = 3


def resolve(policy: AutoShardPolicy, has_files: bool) -> AutoShardPolicy:
    """The policy that applies: AUTO becomes FILE for a file-based dataset, else DATA.

    Example:
      >>> resolve(AutoShardPolicy.AUTO, has_files=False)
      <AutoShardPolicy.DATA: 2>
    """
    if policy is AutoShardPolicy.AUTO:
        return AutoShardPolicy.FILE if has_files else AutoShardPolicy.DATA
    return policy


def shard_files(api: str, files: Sequence, num_workers: int, worker: int) -> list:
    """The files worker ``worker`` of ``num_workers`` reads under FILE: ``files[worker::W]``.

    Raises:
      ValueError: fewer files than workers, with TensorFlow's advice.

    Example:
      >>> shard_files("api", ["a", "b", "c", "d", "e"], 2, 1)
      ['b', 'd']
    """
    if len(files) < num_workers:
        raise ValueError(
            f"{api}: could not apply FILE based sharding: the dataset only has {len(files)} "
            f"file(s), which is not enough for the required {num_workers} shards/workers. "
            "Set the auto-sharding policy to DATA or OFF (px.tf.DatasetOptions("
            "auto_shard_policy=px.tf.AutoShardPolicy.DATA), dataset.with_options(...)), or "
            "split the input into at least as many files as workers (TensorFlow's rule).")
    return list(files[worker::num_workers])


def shard_elements(elements, num_shards: int, index: int):
    """Elements ``i`` with ``i % num_shards == index`` (TF's ``Dataset.shard``), lazily.

    Example:
      >>> list(shard_elements(range(7), 3, 1))
      [1, 4]
    """
    for i, element in enumerate(elements):
        if i % num_shards == index:
            yield element


def worker_batch_sizes(global_batch: int, num_workers: int, replicas_per_worker: int,
                       worker: int) -> tuple[int, ...]:
    """The ``W * R`` mini-batch sizes worker ``worker`` rebatches each batch of ``G`` rows into.

    TF's ``batch_sizes_for_worker``: ``G // N`` rows each, one more for ``G % N`` of them,
    the extra rows rotated by ``worker * R`` so that every step of the job takes ``G`` rows.

    Example:
      >>> worker_batch_sizes(7, 2, 2, 0), worker_batch_sizes(7, 2, 2, 1)   # TF's docstring
      ((2, 2, 2, 1), (2, 1, 2, 2))
    """
    n = num_workers * replicas_per_worker
    offset = worker * replicas_per_worker
    floor, extra = divmod(global_batch, n)
    return tuple(floor + ((i + offset) % n < extra) for i in range(n))


def legacy_rebatch_sizes(rows: int, num_replicas: int) -> tuple[int, ...]:
    """TF's legacy rebatch of a batch of ``rows``: ``ceil(rows / N)`` each, the last shorter or 0.

    Example:
      >>> legacy_rebatch_sizes(4, 3), legacy_rebatch_sizes(5, 4)
      ((2, 2, 0), (2, 2, 1, 0))
    """
    each = -(-rows // num_replicas)
    return tuple(max(0, min(each, rows - i * each)) for i in range(num_replicas))


def data_shard_minibatches(num_workers: int, replicas_per_worker: int) -> list[int]:
    """Under DATA, the mini-batch of each global batch each replica gets, in replica order.

    Replica ``r`` of worker ``k`` (replica id ``k * R + r``) gets mini-batch ``k + r * W``:
    the shard keeps mini-batches ``i % W == k`` and the worker's replicas take them in turn.

    Example:
      >>> data_shard_minibatches(2, 2)
      [0, 2, 1, 3]
    """
    return [k + r * num_workers for k in range(num_workers) for r in range(replicas_per_worker)]


def rebatch(batch_rows: int, sizes: Sequence[int]) -> list[int]:
    """Mini-batch sizes one batch of ``batch_rows`` rows yields (unbatch, batch by ``sizes``).

    A full batch yields ``sizes``; a short last batch yields them in turn until its rows run
    out, the last one shorter (no empty mini-batches: TF's ``rebatch``).

    Example:
      >>> rebatch(8, (2, 2, 2, 2)), rebatch(5, (2, 2, 2, 2))
      ([2, 2, 2, 2], [2, 2, 1])
    """
    out, left = [], batch_rows
    while left > 0:
        size = sizes[len(out) % len(sizes)]
        out.append(min(size, left))
        left -= out[-1]
    return out
