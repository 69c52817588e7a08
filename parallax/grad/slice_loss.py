"""The loss on one slice of the batch: the module rebuilt inside the trace, its state returned.

``px.value_and_grad`` runs the user's loss on slices of the batch (each device's rows in
the explicit style, each micro-batch). :class:`SliceLoss` is that computation for one
slice: it rebuilds the module from the parameters and the incoming non-parameter state
inside the differentiated function (so a forward pass may write ``BatchStat`` and
``RngCount``), prepares it for the slice (the BatchNorms' ``axis_name``, RNG keys that draw
one device's values for these rows), calls the loss, checks what it returned, and hands
back the loss, the gradients and a :class:`LocalResult`: the auxiliary values, the module
state after the forward pass, the variables it created, and the checks the model asked for
(``check_finite``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from parallax import finite_check
from parallax.grad import backward_records, module_state, sliced_rng
from parallax.grad.aux_outputs import partition_static
from parallax.grad.module_state import StateOptions, Target
from parallax.grad.sliced_rng import Position

API = "px.value_and_grad"


class LocalResult(NamedTuple):
    """What a slice's forward pass produced besides the loss and the gradients.

    Attributes:
      aux: the loss's auxiliary values (array leaves; static leaves are set aside).
      state: the module's non-parameter state after the pass, with the incoming
        structure (None for a plain pytree of parameters).
      new: variables the pass created (``sow``), as an ``nnx.State`` (None without).
      checks: ``{name: ok}`` booleans the model recorded for ``check_finite``.
    """

    aux: Any
    state: Any
    new: Any
    checks: dict


def leading_size(batch) -> int:
    """The number of examples in a batch slice (every leaf's leading dimension)."""
    leaves = jax.tree.leaves(batch)
    return int(leaves[0].shape[0]) if leaves and getattr(leaves[0], "ndim", 0) else 1


def _name(fn) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def split_output(out, has_aux: bool, loss_fn):
    """``(loss, aux)`` from what ``loss_fn`` returned, checked."""
    if has_aux:
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            got = (f"an array of shape {tuple(out.shape)}" if hasattr(out, "shape")
                   else f"a {type(out).__name__}")
            raise TypeError(
                f"{API}: with has_aux=True, {_name(loss_fn)} must return (loss, aux); it "
                f"returned {got}.")
        loss, aux = out
    else:
        if isinstance(out, (tuple, list)):
            raise TypeError(
                f"{API}: {_name(loss_fn)} returned a {type(out).__name__} of {len(out)}; "
                "return the loss alone, or pass has_aux=True to return (loss, aux).")
        loss, aux = out, None
    shape = getattr(loss, "shape", None)
    if shape is None or not hasattr(loss, "dtype"):
        raise TypeError(f"{API}: {_name(loss_fn)} must return a scalar array loss; it "
                        f"returned {type(loss).__name__}.")
    if shape != ():
        raise ValueError(
            f"{API}: {_name(loss_fn)} must return a scalar loss (the mean over the batch's "
            f"examples); it returned shape {tuple(shape)}. Reduce it, e.g. jnp.mean(...).")
    if not jnp.issubdtype(loss.dtype, jnp.floating):
        raise TypeError(f"{API}: {_name(loss_fn)} must return a floating loss; it returned "
                        f"dtype {loss.dtype}.")
    return loss, aux


def _merge_checks(records) -> dict:
    checks: dict = {}
    for name, ok in records:
        checks[name] = ok if name not in checks else checks[name] & ok
    return checks


@dataclasses.dataclass
class SliceLoss:
    """``(params, batch) -> ((loss, LocalResult), grads)`` for one slice of the batch.

    Called as a function it computes the slice at :attr:`position` from :attr:`state`
    (what a strategy's gradient producer receives as ``GradRequest.value_and_grad``);
    :meth:`run` takes both explicitly (what micro-batch accumulation threads).

    Attributes:
      loss_fn: the user's ``loss_fn(model_or_params, batch, *args)``.
      target: the split module (or plain parameters).
      args: extra arguments for ``loss_fn``.
      has_aux: ``loss_fn`` returns ``(loss, aux)``.
      options: batch statistics and RNG modes.
      axes: the manual batch axes of the computation (BatchNorm reduces over them).
      state: the incoming non-parameter state.
      position: the slice's place in one device's batch.
      statics: where static auxiliary leaves are set aside while tracing.
      check: record the model's checks (a step with ``check_finite=True``).
      hooks: the strategy's ``model_hooks.before_loss``, run on the rebuilt module.
      precision: the strategy's ``parallax.precision.Policy``: parameters and floating
        batch leaves cast to its compute dtype, the loss back to float32.
      scale: the loss scale the loss is multiplied by (None: not scaled).
    """

    loss_fn: Callable
    target: Target
    args: tuple
    has_aux: bool
    options: StateOptions
    axes: tuple[str, ...] = ()
    state: Any = None
    position: Position = sliced_rng.WHOLE
    statics: dict = dataclasses.field(default_factory=dict)
    check: bool = False
    hooks: tuple = ()
    precision: Any = None
    scale: Any = None

    def at(self, state, position: Position) -> SliceLoss:
        """This loss for the slice at ``position``, starting from ``state``."""
        return dataclasses.replace(self, state=state, position=position)

    def __call__(self, params, batch):
        return self.run(params, self.state, batch, self.position)

    def run(self, params, state, batch, position: Position):
        """The loss, the :class:`LocalResult` and the gradients of one slice."""
        rows = leading_size(batch)
        target = self.target

        policy = self.precision
        inputs = batch if policy is None else policy.to_compute(batch)

        # Variables the backward pass writes (backward_records) are differentiated too:
        # their cotangents are their values after the step.
        recorded, others = (backward_records.split_records(state) if target.is_module
                            else (None, None))
        recording = recorded is not None and backward_records.has_records(recorded)

        def local(p, recorded):
            # The cast is inside the differentiated function: the gradient with respect to
            # the stored (master) parameters comes out through it.
            p = p if policy is None else policy.to_compute(p)
            with finite_check.scope(self.check) as records:
                if target.is_module:
                    incoming = nnx.merge_state(others, recorded) if recording else state
                    # A fresh copy of every variable, created at this trace level: the
                    # forward pass may write to it.
                    fresh = jax.tree.map(lambda x: x, incoming)
                    keys = sliced_rng.slice_keys(fresh, position, rows, self.options.rng)
                    model = target.module(p, keys)
                    module_state.prepare(model, self.options, self.axes)
                    for hook in self.hooks:
                        hook(model)
                else:
                    model = p
                out = self.loss_fn(model, inputs, *self.args)
            loss, aux = split_output(out, self.has_aux, self.loss_fn)
            if policy is not None:
                loss = loss.astype(jnp.float32)
            if self.scale is not None:
                loss = loss * self.scale
            aux, self.statics["aux"] = partition_static(aux)
            carried = new = None
            if target.is_module:
                carried, new = target.state_after(model)
                # Keys are restored: a forward pass draws from them, it does not move them.
                # State keeps its dtype whatever the compute dtype (BatchNorm statistics).
                carried = jax.tree.map(lambda after, before: before if sliced_rng.is_key(before)
                                       else jnp.asarray(after, before.dtype), carried, state)
                new = sliced_rng.unslice_keys(new)
            return loss, LocalResult(aux, carried, new, _merge_checks(records))

        if not recording:
            return jax.value_and_grad(local, has_aux=True)(params, recorded)
        (loss, res), (grads, written) = jax.value_and_grad(local, argnums=(0, 1),
                                                           has_aux=True)(params, recorded)
        return (loss, res._replace(state=backward_records.with_records(res.state, written))), grads
