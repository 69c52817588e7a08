"""Data parallelism: replicate the model, split the batch, all-reduce the gradients."""

from __future__ import annotations

from collections.abc import Callable

from parallax.strategy import Strategy, check_style


def DataParallel(axis: str = "data", *, style: str | None = None,
                 sync: Callable | None = None) -> Strategy:
    """Replicates every parameter and splits the batch over ``axis``.

    Each device computes gradients on its slice of the batch; the gradients are then summed
    over ``axis`` with one all-reduce per step and divided by the number of slices, so the
    update is that of the full batch. This is PyTorch's ``DistributedDataParallel`` and
    Horovod's data parallelism, expressed as SPMD.

    Args:
      axis: the mesh axis that splits the batch.
      style: ``"explicit"`` (default: local gradients in ``shard_map``, then ``psum``) or
        ``"gspmd"`` (XLA inserts the all-reduce).
      sync: how the explicit style sums the gradients (over every batch axis of the
        composed strategy): ``px.BucketedSync(bucket_bytes=...)`` for DDP's buckets, or any
        ``sync(grads, axes) -> grads`` (see :mod:`parallax.strategies.sync`). None: one
        ``psum`` per leaf.

    Returns:
      A :class:`parallax.Strategy`.

    Example:
      >>> import parallax as px
      >>> px.DataParallel("data").batch_axes
      ('data',)

    References:
      Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training",
      VLDB 2020. Sergeev & Del Balso, "Horovod", 2018.
    """
    style = check_style("px.DataParallel", style)
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
