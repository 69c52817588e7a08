"""Gradient accumulation: split each device's batch into micro-batches, average their gradients.

The mechanism (the split and the ``lax.scan``) is :mod:`parallax.grad.microbatches`, which
``px.value_and_grad(microbatches=k)`` and the pipelines use too.
"""

from __future__ import annotations

from parallax.grad.microbatches import accumulate, check_microbatches
from parallax.strategy import Strategy


def GradientAccumulation(microbatches: int) -> Strategy:
    """Produces gradients from ``microbatches`` equal slices of each device's batch.

    Peak activation memory is that of one micro-batch; the result is numerically the full
    batch's (a mean of equal-sized means), up to float rounding. Compose it with any
    data-parallel strategy: the split happens on each device's local batch. It takes the
    *mean* of the micro-batches' gradients because it splits one batch; Horovod's
    ``backward_passes_per_step`` (``hvd.DistributedOptimizer``) and DDP's ``no_sync``
    accumulate separate steps' gradients and *sum* them.

    Example:
      >>> import parallax as px
      >>> s = px.compose(px.DataParallel("data"), px.GradientAccumulation(4))

    References:
      Huang et al., "GPipe", 2019 (micro-batches and gradient accumulation).
    """
    check_microbatches({}, microbatches, "px.GradientAccumulation")

    def grad_fn(request, params, batch):
        return accumulate(request.value_and_grad, params, batch, microbatches,
                          api="px.GradientAccumulation")

    return Strategy(name=f"GradientAccumulation({microbatches})", grad_fn=grad_fn,
                    microbatches=microbatches)
