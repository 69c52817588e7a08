"""How gradients are produced on one slice of the batch: a strategy's producer, or
accumulation over micro-batches.

``px.value_and_grad`` (:mod:`parallax.grad`) synchronises gradients over the batch axes;
what runs on each device's slice before that is decided here. A strategy with a
``grad_fn`` (gradient accumulation, pipeline schedules) receives a :class:`GradRequest`;
otherwise the slice's loss is accumulated over micro-batches
(:func:`parallax.grad.microbatches.accumulate`). Either way the result carries the module's
non-parameter state (:class:`parallax.grad.slice_loss.LocalResult`). A producer that rebuilds the
module itself carries that state by reading it from the request's slice loss and returning
it in a ``LocalResult`` (as ``px.Pipeline`` does, :mod:`parallax.pipeline.runtime.module_state`);
``GradRequest.rebuild`` carries none, and refuses a model that has any.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from parallax.grad.slice_loss import LocalResult, SliceLoss
from parallax.grad.microbatches import accumulate
from parallax.grad.module_state import Target

API = "px.value_and_grad"


class GradRequest(NamedTuple):
    """What a strategy's gradient producer (``Strategy.grad_fn``) is asked to compute.

    ``grad_fn(request, params, batch) -> ((loss, aux), grads)`` runs on each device's slice
    of the batch (inside the data-parallel ``shard_map`` in the explicit style) and must not
    synchronise over the batch axes: ``px.value_and_grad`` does that afterwards.

    Attributes:
      value_and_grad: ``(params, batch) -> ((loss, aux), grads)``, the plain computation on
        the slice (a :class:`parallax.grad.slice_loss.SliceLoss`: its ``aux`` is a
        ``LocalResult`` carrying the module's state; ``parallax.grad.microbatches.accumulate``
        threads it through micro-batches).
      loss_fn: the user's loss function (a producer may look inside it, e.g. a pipeline
        reads the stages of a ``parallax.pipeline`` loss).
      rebuild: ``params -> what loss_fn takes`` (the NNX module, or the params themselves)
        for producers that do not carry module state; it raises for a module whose
        forward pass writes state (BatchNorm, RNG streams). A producer that carries it reads
        ``value_and_grad.target`` / ``.state`` / ``.position`` / ``.options`` instead and
        returns a ``LocalResult`` as its aux.
      args: the extra arguments passed to ``loss_fn`` after the batch.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    """

    value_and_grad: Callable
    loss_fn: Callable
    rebuild: Callable
    args: tuple
    has_aux: bool


def split_target(target):
    """(params, rebuild): an NNX module is differentiated w.r.t. its ``nnx.Param`` state.

    For producers that rebuild the module themselves and carry no state: a module holding
    BatchNorm statistics or RNG streams is refused with a message.
    """
    parts = Target.of(target)
    return parts.params, stateless_rebuild(parts, "this gradient producer")


def stateless_rebuild(parts: Target, who: str) -> Callable:
    """``parts.rebuild``, refusing a module whose forward pass would write state."""
    if not parts.has_stateful():
        return parts.rebuild

    def refuse(params):
        raise ValueError(
            f"{API}: {who} produces gradients by rebuilding the model from its parameters "
            f"alone (GradRequest.rebuild), which drops the module's non-parameter state: the "
            f"model holds {', '.join(parts.stateful_paths()[:4])}. In the producer, read the "
            "state from GradRequest.value_and_grad (.target, .state, .position) and return a "
            "parallax.grad.slice_loss.LocalResult as its aux, as px.Pipeline does; or give the "
            "model no stored state (nnx.LayerNorm instead of BatchNorm; dropout via "
            "px.nn.dropout with a key passed in).")

    return refuse


def gradient_producer(local: SliceLoss, strategy, microbatches: int | None):
    """``(produce, split)``: ``produce(params, batch, state, position) -> ((loss,
    LocalResult), grads)`` on one batch slice, by the strategy's producer or by plain
    accumulation over ``split`` micro-batches."""
    hook = strategy.grad_fn if strategy is not None else None
    if microbatches is not None and hook is not None:
        raise ValueError(
            f"{API}: microbatches={microbatches} was given, but the strategy "
            f"{strategy.name} already decides how gradients are produced; pass one of them."
        )
    if hook is not None:
        rebuild = stateless_rebuild(local.target, strategy.name)

        def produce(params, batch, state, position):
            request = GradRequest(local.at(state, position), local.loss_fn, rebuild,
                                  local.args, local.has_aux)
            (loss, aux), grads = hook(request, params, batch)
            if not isinstance(aux, LocalResult):  # a producer that carries no state
                aux = LocalResult(aux, state, None, {})
            return (loss, aux), grads

        return produce, strategy.microbatches
    split = microbatches or (strategy.microbatches if strategy is not None else 1)
    return (lambda p, b, s, pos: accumulate(local.at(s, pos), p, b, split, api=API)), split
