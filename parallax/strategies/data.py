"""Data parallelism: replicate the model, split the batch, all-reduce the gradients."""

from __future__ import annotations

from collections.abc import Callable

from parallax.grad.default_sync import ALGORITHMS, AllReduceSync
from parallax.strategy import Strategy, check_style

# sync= spellings of one all-reduce per gradient ("auto" stays AllReduceSync("auto"): the
# word would read as the backend's choice, which is sync=None).
SYNC_NAMES = tuple(a for a in ALGORITHMS if a != "auto")


def DataParallel(axis: str = "data", *, style: str | None = None,
                 sync: Callable | str | None = None) -> Strategy:
    """Replicates every parameter and splits the batch over ``axis``.

    Each device computes gradients on its slice of the batch; the gradients are then summed
    over ``axis`` with one all-reduce per step and divided by the number of slices, so the
    update is that of the full batch. This is PyTorch's ``DistributedDataParallel`` and
    Horovod's data parallelism, expressed as SPMD.

    Args:
      axis: the mesh axis that splits the batch.
      style: ``"explicit"`` (default: local gradients in ``shard_map``, then their sums) or
        ``"gspmd"`` (XLA inserts the all-reduce).
      sync: how the explicit style sums the gradients (over every batch axis of the
        composed strategy). None (the default): the backend's fast choice, made when the
        step is traced (:mod:`parallax.grad.default_sync`): parallax.comm's tree exchange
        when the batch axes span CPU devices of several processes (gloo), XLA's all-reduce
        otherwise (NCCL on GPU, ICI on TPU, one process of CPU devices). ``"xla"``,
        ``"tree"`` or ``"ring"``: that all-reduce everywhere (``px.AllReduceSync``).
        ``px.BucketedSync(bucket_bytes=...)`` for DDP's buckets, or any
        ``sync(grads, axes) -> grads`` (see :mod:`parallax.strategies.sync`).

    Returns:
      A :class:`parallax.Strategy`.

    Example:
      >>> import parallax as px
      >>> px.DataParallel("data").batch_axes
      ('data',)
      >>> px.DataParallel("data", sync="xla").grad_sync
      AllReduceSync(algorithm='xla')

    References:
      Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training",
      VLDB 2020. Sergeev & Del Balso, "Horovod", 2018.
    """
    style = check_style("px.DataParallel", style)
    if isinstance(sync, str):
        if sync not in SYNC_NAMES:
            raise ValueError(
                f"px.DataParallel: sync={sync!r} must be one of "
                f"{', '.join(map(repr, SYNC_NAMES))} (one all-reduce per gradient: XLA's, or "
                "parallax.comm's exchanges), None for the backend's choice, or a callable "
                "such as px.BucketedSync().")
        sync = AllReduceSync(sync)
    if sync is not None and not callable(sync):
        raise TypeError(
            f"px.DataParallel: sync must be callable as sync(grads, axes) -> grads, e.g. "
            f"px.BucketedSync(bucket_bytes=25 * 2**20); got {type(sync).__name__}: {sync!r}.")
    if sync is not None and style == "gspmd":
        raise ValueError(
            "px.DataParallel: sync= replaces the explicit style's all-reduce, but "
            "style='gspmd' leaves the gradient sum to XLA; drop one of them.")
    name = f"DataParallel({axis!r}" + (f", sync={sync!r})" if sync is not None else ")")
    return Strategy(name=name, batch_axes=(axis,), style=style, grad_sync=sync)
