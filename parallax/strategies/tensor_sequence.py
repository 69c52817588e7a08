"""Sequence parallelism for planned stock modules: Megatron's activation layouts, pinned.

With ``px.TensorParallel(axis, plan=..., sequence_parallel=True)`` the residual stream
``[B, T, D]`` is split along its sequence over the tensor axis between the tensor-parallel
regions (Korthikanti et al.): a norm runs on ``T / n`` positions, a column-parallel layer
first all-gathers the sequence, a row-parallel layer reduce-scatters its output back to
sequence shards instead of all-reducing it. An annotated model writes those layouts with
``px.constrain``; a stock ``nnx.Linear`` cannot, so the plan does it for the modules it
styles: inside ``px.value_and_grad`` each planned module's class is swapped for a
subclass whose ``__call__`` constrains its input and output, as torchtitan's
``input_layouts`` / ``output_layouts`` do:

==========================  ===============================  ==========================
style                       input                            output
==========================  ===============================  ==========================
``"colwise"``, ``"vocab"``  whole sequence (all-gather)      as computed
(a linear), ``"attention"``
``"rowwise"``               as computed                      sequence shards
                                                             (reduce-scatter)
``"attention"``             whole sequence                   sequence shards
``"vocab"`` (an embedding)  token ids, as given              sequence shards
``"sequence"``              sequence shards                  sequence shards
(norms, dropout)
==========================  ===============================  ==========================

Only activations of rank 3 or more (``[batch, sequence, ...]``) are constrained; the
module's parameters, state and paths are unchanged.

References:
  Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
  2022. Liang et al., "TorchTitan", 2024 (``SequenceParallel``, ``input_layouts``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from flax import nnx
from jax.sharding import PartitionSpec

from parallax import context
from parallax.rules import as_tuple

WHOLE, SHARDED = "whole", "sharded"
# style -> (input layout, output layout); None leaves it to XLA.
_LAYOUTS = {
    "colwise": (WHOLE, None),
    "rowwise": (None, SHARDED),
    "attention": (WHOLE, SHARDED),
    "vocab": (WHOLE, None),
    "sequence": (SHARDED, SHARDED),
    "replicate": (None, None),
}


def _constrain(x, layout: str | None, axis: str):
    """``x`` constrained to its sequence dimension whole or split over ``axis``."""
    ctx = context.current()
    if layout is None or ctx is None or getattr(x, "ndim", 0) < 3:
        return x
    batch = tuple(a for a in ctx.strategy.batch_axes
                  if a in ctx.mesh.shape and a not in ctx.manual_axes)
    lead = batch if len(batch) > 1 else (batch[0] if batch else None)
    seq = axis if layout == SHARDED and x.shape[1] % ctx.mesh.shape[axis] == 0 else None
    spec = PartitionSpec(lead, seq, *([None] * (x.ndim - 2)))
    return jax.lax.with_sharding_constraint(x, spec)


@functools.cache
def _sequence_class(cls: type, style: str, axis: str) -> type:
    """``cls`` with its ``__call__`` wrapped in the style's layouts (one class per triple)."""
    before, after = _LAYOUTS[style]
    if isinstance(cls, type) and issubclass(cls, nnx.Embed):
        before = None  # the input is token ids

    def __call__(self, x, *args, **kwargs):
        x = _constrain(x, before, axis)
        args = tuple(_constrain(a, before, axis) if style == "attention" and
                     getattr(a, "ndim", 0) >= 3 else a for a in args)
        return _constrain(cls.__call__(self, x, *args, **kwargs), after, axis)

    return type(f"SequenceParallel{cls.__name__}", (cls,), {"__call__": __call__})


@dataclasses.dataclass(frozen=True)
class SequenceLayouts:
    """A ``ModelHooks.before_loss`` entry: pins sequence-parallel layouts on planned modules.

    Attributes:
      plan: the ``TensorPlan`` whose styles say which module gets which layout.
      axis: the tensor (and sequence) mesh axis.
    """

    plan: object
    axis: str

    def __call__(self, model: nnx.Module, api: str = "px.TensorParallel") -> None:
        ctx = context.current()
        if ctx is None or self.axis not in as_tuple(ctx.strategy.rule_table.get("sequence")):
            return
        if self.axis not in ctx.mesh.shape or ctx.mesh.shape[self.axis] == 1:
            return
        for style, module in self.plan.styles(model, api).values():
            cls = type(module)
            if not cls.__name__.startswith("SequenceParallel"):
                object.__setattr__(module, "__class__", _sequence_class(cls, style, self.axis))
