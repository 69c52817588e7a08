"""GPipe as a forward scan differentiated by autodiff: the simple SPMD pipeline.

Each of ``M + S - 1`` ticks, every stage applies its layers to what it holds (stage 0 to the
next micro-batch's ``first``), the last stage adds a micro-batch's loss, and the outputs move
one stage forward with a ``ppermute``. ``jax.value_and_grad`` of that loop is the backward:
the transposed ``ppermute`` carries gradients back, and autodiff keeps every tick's residuals
(GPipe's memory, ``M`` micro-batches in flight) unless the stage is rematerialised. This is
the pipeline MaxText and praxis run; the table runtime (:mod:`parallax.pipeline.runtime.ticks`)
must agree with it on ``"gpipe"``, and does (tested).

Unlike the table runtime, the bubble ticks compute on placeholder inputs (their results are
discarded), and ``first`` / ``last`` run under ``lax.cond`` on the stages that need them.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from parallax import context
from parallax.comm import nesting
from parallax.grad.gradients import split_target
from parallax.grad.microbatches import check_microbatches
from parallax.pipeline.runtime import module_state
from parallax.pipeline.runtime import ticks
from parallax.pipeline.runtime.checks import check_positive_int, check_remat
from parallax.pipeline.runtime.layer_moves import check_layers
from parallax.pipeline.runtime.program import program
from parallax.pipeline.stages import Stages
from parallax.comm.varying import varying_axes

API = "px.pipeline.gpipe_value_and_grad"


def gpipe_value_and_grad(stages: Stages, *, microbatches: int, axis: str = "stage",
                         remat="never") -> Callable:
    """GPipe by autodiff of a forward scan over ticks: ``fn(model, batch) -> (loss, grads)``.

    Args:
      stages: the pipelined loss (:class:`Stages`).
      microbatches: micro-batches per step.
      axis: the mesh axis of the pipeline (the mesh comes from ``jax.set_mesh``).
      remat: ``"never"``, ``"always"`` (checkpoint each stage's forward, as torchgpipe) or a
        ``jax.checkpoint_policies`` name. ``"except_last"`` needs the table runtime
        (:func:`value_and_grad`), whose ticks know their micro-batch.

    Returns:
      ``fn(model_or_params, batch) -> (loss, grads)``, as :func:`value_and_grad`.

    Example:
      >>> import jax, jax.numpy as jnp, parallax as px
      >>> from parallax.pipeline import Stages, gpipe_value_and_grad
      >>> loss = Stages(lambda p, b: b["x"], lambda w, x: jnp.tanh(x @ w) + x,
      ...               lambda p, x, b: jnp.mean(x ** 2), lambda p: p["layers"])
      >>> params, batch = {"layers": jnp.eye(4)[None].repeat(2, 0)}, {"x": jnp.ones((8, 4))}
      >>> with jax.set_mesh(px.make_mesh(stage=2, devices=jax.devices()[:2])):
      ...     value, _ = jax.jit(gpipe_value_and_grad(loss, microbatches=2))(params, batch)
      >>> bool(jnp.allclose(value, loss(params, batch)))
      True

    References:
      Huang et al. 2019, GPipe; Kim et al. 2020, torchgpipe (checkpointing).
    """
    if not isinstance(stages, Stages):
        raise TypeError(f"{API}: the loss must be a px.pipeline.Stages, got "
                        f"{type(stages).__name__}")
    microbatches = check_positive_int("microbatches", microbatches, API)
    mode, policy = check_remat(remat, API)
    if mode == "except_last":
        raise ValueError(f"{API}: remat='except_last' needs the table runtime; use "
                         "px.pipeline.value_and_grad(stages, 'gpipe', ...) or remat='always'")

    def fn(target, batch):
        module_state.stateless(
            target, API, "which GPipe by autodiff cannot carry (its backward re-runs the "
            "forward); use px.pipeline.value_and_grad(stages, 'gpipe', microbatches=..., "
            "batch_stats='per_microbatch'), whose table runtime carries it")
        params, rebuild = split_target(target)
        return _gpipe(stages, params, rebuild, batch, microbatches, axis,
                      remat=mode == "always", policy=policy)

    return fn


def _gpipe(stages, params, rebuild, batch, M: int, axis: str, *, remat: bool, policy):
    S = ticks.stage_count(axis, None, API)
    check_microbatches(batch, M, API)
    prog = program(stages, params, rebuild, API)
    L = prog.stacked[0].shape[0]
    check_layers(L, S, 1, API, axis)
    micro = jax.tree.map(lambda x: x.reshape(M, x.shape[0] // M, *x.shape[1:]), batch)
    outer = frozenset().union(*(varying_axes(x) for x in jax.tree.leaves(
        (prog.stacked, prog.others, batch))))
    vary = ticks.caster(outer | {axis})

    def chunk(params, x):
        return lax.scan(lambda x, p: (prog.layer(p, x, [])[0], None), x, params)[0]

    if remat or policy is not None:
        chunk = jax.checkpoint(chunk, policy=policy)

    def body(stacked, others, micro):
        stacked, others = [vary(p) for p in stacked], [vary(o) for o in others]
        micro = jax.tree.map(vary, micro)
        s = lax.axis_index(axis)
        pick = lambda m: jax.tree.map(lambda x: lax.dynamic_index_in_dim(  # noqa: E731
            x, jnp.clip(m, 0, M - 1), keepdims=False), micro)

        def local_loss(stacked, others):
            def tick(carry, t):
                held, total = carry
                x = lax.cond(s == 0, lambda: jax.tree.map(vary, prog.first(others, [],
                                                                           pick(t))[0]),
                             lambda: held)
                y = chunk(stacked, x)
                m = t - (S - 1)
                part = lax.cond((s == S - 1) & (m >= 0),
                                lambda: vary(prog.last(others, [], y, pick(m))[0].astype(
                                    jnp.float32)),
                                lambda: vary(jnp.zeros((), jnp.float32)))
                if S > 1:
                    y = lax.ppermute(y, axis, [(i, (i + 1) % S) for i in range(S)])
                return (y, total + part), None

            x0 = jax.tree.map(lambda a: vary(jnp.zeros(a.shape, a.dtype)),
                              jax.eval_shape(lambda: prog.first(others, [], pick(0))[0]))
            (_, total), _ = lax.scan(tick, (x0, vary(jnp.zeros((), jnp.float32))),
                                     jnp.arange(M + S - 1))
            return total / M

        loss, (d_stacked, d_others) = jax.value_and_grad(local_loss, argnums=(0, 1))(
            stacked, others)
        return lax.psum(loss, axis), d_stacked, [lax.psum(g, axis) for g in d_others]

    nesting.check({axis}, API, nesting.PIPELINE_FIX)
    with context.manual((axis,)):
        loss, d_stacked, d_others = jax.shard_map(
            body,
            in_specs=([P(axis)] * len(prog.stacked), [P()] * len(prog.others),
                      jax.tree.map(lambda _: P(), micro)),
            out_specs=(P(), [P(axis)] * len(prog.stacked), [P()] * len(prog.others)),
            axis_names=frozenset({axis}),
        )(prog.stacked, prog.others, micro)
    return loss, prog.grads(d_stacked, d_others)
