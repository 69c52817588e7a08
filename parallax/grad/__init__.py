"""Around gradients: ``px.value_and_grad`` (:mod:`~parallax.grad.gradients`), the gradient
producer a strategy chooses (:mod:`~parallax.grad.producer`), micro-batches
(:mod:`~parallax.grad.microbatches`), the loss on one slice of the batch
(:mod:`~parallax.grad.slice_loss`), the module's non-parameter state
(:mod:`~parallax.grad.module_state`), random draws sliced as one device's
(:mod:`~parallax.grad.sliced_rng`), auxiliary outputs reduced by kind
(:mod:`~parallax.grad.aux_outputs`) and collectives on a leaf's local shards
(:mod:`~parallax.grad.local_shards`)."""

from parallax.grad.gradients import split_target as split_target
from parallax.grad.gradients import value_and_grad as value_and_grad
