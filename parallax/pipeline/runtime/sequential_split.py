"""The B/W split on one device: what splitting the backward costs, without a pipeline.

The zero-bubble schedules run each layer's backward as two actions (Qi et al. 2024): ``B``
(the input gradient; it keeps the gradient at every use of a parameter) and ``W`` (the
weight gradients, from those and the operands ``F`` stashed). ``W`` reads what ``B``
stored, and reads the operands a second time: bytes the split costs by itself, pipeline or
not. This function runs that split on one device over the whole batch, the way the
sequential program runs autodiff: a ``lax.scan`` over the layers for ``F`` (what each
layer stashes stacked as the scan's outputs), a reverse scan for ``B``, a scan for ``W``,
with the runtime's own layer split (:mod:`parallax.pipeline.runtime.chunk`). So
``benchmarks/pipeline.py`` tells a split schedule's runtime overhead (its bytes over this
program's) from the split's own (this program's over autodiff's).

Stateless models only (no BatchNorm statistics or RNG streams): it is a reference for
measurements, not a training path.
"""

from __future__ import annotations

import jax
from jax import lax

from parallax.pipeline.runtime import module_state
from parallax.pipeline.runtime.checks import check_remat
from parallax.pipeline.runtime.chunk import Chunk, template
from parallax.pipeline.runtime.program import program
from parallax.pipeline.stages import Stages

API = "px.pipeline.split_value_and_grad"


def split_value_and_grad(stages: Stages, *, remat: str = "never"):
    """``fn(params, batch) -> (loss, grads)``: ``stages``'s loss and gradients with every
    layer's backward split into ``B`` and ``W``, on one device, whole batch.

    Args:
      stages: the loss (:class:`parallax.pipeline.Stages`).
      remat: ``"never"`` or a ``jax.checkpoint_policies`` name applied to every layer
        (the torchgpipe options need micro-batches, which this program has none of).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from parallax.pipeline import Stages
      >>> loss = Stages(lambda p, b: b["x"], lambda w, x: jnp.tanh(x @ w) + x,
      ...               lambda p, x, b: jnp.mean(x ** 2), lambda p: p["layers"])
      >>> params, batch = {"layers": jnp.eye(4)[None].repeat(2, 0)}, {"x": jnp.ones((8, 4))}
      >>> value, grads = jax.jit(split_value_and_grad(loss))(params, batch)
      >>> bool(jnp.allclose(grads["layers"], jax.grad(loss)(params, batch)["layers"]))
      True
    """
    mode, policy = check_remat(remat, API)
    if mode in ("always", "except_last"):
        raise ValueError(f"{API}: remat={remat!r} rematerialises micro-batches, and this "
                         "program has none; use 'never' or a jax.checkpoint_policies name")

    def same(x):
        return x

    def fn(target, batch):
        parts = module_state.stateless(
            target, API, "which this one-device reference does not carry: measure the split "
            "on a model without BatchNorm statistics or RNG streams, or train it with "
            "px.pipeline.value_and_grad")
        prog = program(stages, parts.params, parts.rebuild, API)
        x, _ = prog.first(prog.others, [], batch)
        chunk = Chunk(prog.layer, template(prog.layer, [p[0] for p in prog.stacked], x,
                                           same, policy, API), same, policy)

        def forward(x, p):
            y, (kept, _) = chunk.forward_layer(p, x, [])
            return y, kept

        y, stash = lax.scan(forward, x, prog.stacked)
        (loss, _), (d_last, dy) = jax.value_and_grad(
            lambda o, y: prog.last(o, [], y, batch), argnums=(0, 1), has_aux=True)(
            prog.others, y)
        dx, uses = lax.scan(lambda g, xs: chunk.input_grads(xs[0], xs[1], g), dy,
                            (prog.stacked, stash), reverse=True)
        _, d_stacked = lax.scan(lambda _, xs: (None, chunk.weight_grads(*xs)), None,
                                (prog.stacked, stash, uses))
        _, pullback = jax.vjp(lambda o: prog.first(o, [], batch)[0], prog.others)
        d_others = [a + b for a, b in zip(d_last, pullback(dx)[0])]
        return loss, prog.grads(d_stacked, d_others)

    return fn
