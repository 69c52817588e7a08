"""Data parallelism: replicate the model, split the batch, all-reduce the gradients."""

from __future__ import annotations

from parallax.strategy import Strategy, check_style


def DataParallel(axis: str = "data", *, style: str | None = None) -> Strategy:
    """Replicates every parameter and splits the batch over ``axis``.

    Each device computes gradients on its slice of the batch; the gradients are then summed
    over ``axis`` with one all-reduce per step and divided by the number of slices, so the
    update is that of the full batch. This is PyTorch's ``DistributedDataParallel`` and
    Horovod's data parallelism, expressed as SPMD.

    Args:
      axis: the mesh axis that splits the batch.
      style: ``"explicit"`` (default: local gradients in ``shard_map``, then ``psum``) or
        ``"gspmd"`` (XLA inserts the all-reduce).

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
    return Strategy(name=f"DataParallel({axis!r})", batch_axes=(axis,), style=style)
