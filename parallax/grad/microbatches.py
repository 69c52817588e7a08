"""Micro-batches: split a batch into equal slices and accumulate their gradients.

The mechanism that gradient accumulation (``px.GradientAccumulation``,
``px.value_and_grad(microbatches=k)``) and the pipelines (``parallax.pipeline``) share: a
check that a batch splits, the split itself, and a ``lax.scan`` that sums each micro-batch's
gradients and reduces its loss and auxiliary values by kind (:mod:`parallax.grad.aux_outputs`).

With a module whose forward pass writes state (:mod:`parallax.grad.module_state`), the micro-batches
follow the batch-statistics mode: ``"per_microbatch"`` threads the state through them one
after another, as a plain loop would; otherwise every micro-batch starts from the incoming
state and draws its slice of one device's random values, and a BatchNorm in training mode
makes them one computation (its statistics need the whole batch).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from parallax.grad.aux_outputs import check_batch_independent, exact_leaves, over_microbatches
from parallax.grad.slice_loss import LocalResult, SliceLoss, leading_size


def check_microbatches(batch, microbatches: int, api: str, shards: int = 1) -> None:
    """Each of the ``shards`` slices of every batch leaf must split into ``microbatches``."""
    check_count(microbatches, api)
    for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
        size = leaf.shape[0] if getattr(leaf, "ndim", 0) else 0
        if size % (shards * microbatches):
            where = jax.tree_util.keystr(path) or "batch"
            per = f" ({size // shards} per device over {shards} batch shards)" if shards > 1 else ""
            raise ValueError(
                f"{api}: microbatches={microbatches} does not divide the batch: leaf {where} "
                f"has {size} examples{per}; use a batch size that is a multiple of "
                f"{shards * microbatches}, or a number of micro-batches that divides "
                f"{size // shards}."
            )


def check_count(microbatches, api: str) -> int:
    """A micro-batch count must be a positive int (0 is not "no accumulation")."""
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"{api}: microbatches={microbatches!r} must be a positive int "
                         "(1: no accumulation).")
    return microbatches


def split_microbatches(batch, microbatches: int, api: str):
    """Reshapes every batch leaf ``[B, ...]`` to ``[microbatches, B // microbatches, ...]``."""
    check_microbatches(batch, microbatches, api)
    return jax.tree.map(
        lambda x: x.reshape(microbatches, x.shape[0] // microbatches, *x.shape[1:]), batch
    )


def _wide(x):
    if jnp.issubdtype(x.dtype, jnp.floating):
        return x.astype(jnp.promote_types(x.dtype, jnp.float32))
    return x


def _stack(first, rest):
    return jax.tree.map(lambda a, b: jnp.concatenate([a[None], b]), first, rest)


def accumulate(value_and_grad_fn, params, batch, microbatches: int, *, api="px.value_and_grad"):
    """Mean loss, aux and gradients over micro-batches, with a ``lax.scan``.

    ``value_and_grad_fn(params, batch) -> ((loss, aux), grads)``. The loss must be a mean
    over examples, so the mean over equal micro-batches is the full batch's value.
    Gradients accumulate in float32 (or the gradient's dtype when wider) and are cast back
    at the end; auxiliary values are reduced by kind (:func:`parallax.grad.aux_outputs.over_microbatches`:
    per-example values concatenated, floats averaged). A :class:`parallax.grad.slice_loss.SliceLoss`
    also carries the module's state (see the module docstring).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> f = jax.value_and_grad(lambda w, b: (jnp.mean(b @ w), None), has_aux=True)
      >>> (loss, _), g = accumulate(f, jnp.ones(3), jnp.ones((8, 3)), 4)
      >>> float(loss)
      3.0
    """
    if isinstance(value_and_grad_fn, SliceLoss):
        return _accumulate_slices(value_and_grad_fn, params, batch, microbatches, api)
    if microbatches == 1:
        return value_and_grad_fn(params, batch)
    chunks = split_microbatches(batch, microbatches, api)
    rows = leading_size(batch) // microbatches

    # The first micro-batch seeds the sums: its values already have the right types, including
    # which mesh axes they vary over inside shard_map, which zeros would not.
    (loss0, aux0), grads0 = value_and_grad_fn(params, jax.tree.map(lambda x: x[0], chunks))
    if exact_leaves(aux0, rows):
        check_batch_independent(lambda c: value_and_grad_fn(params, c)[0][1], chunks, rows,
                                api=api, what="auxiliary value")

    def body(grads, chunk):
        (loss, aux), g = value_and_grad_fn(params, chunk)
        return jax.tree.map(lambda c, x: c + x.astype(c.dtype), grads, g), (loss, aux)

    rest = jax.tree.map(lambda x: x[1:], chunks)
    grads, (losses, auxes) = jax.lax.scan(body, jax.tree.map(_wide, grads0), rest)
    loss, aux = over_microbatches(_stack((loss0, aux0), (losses, auxes)), microbatches, rows)
    grads = jax.tree.map(lambda g, like: (g / microbatches).astype(like.dtype), grads, grads0)
    return (loss, aux), grads


def _accumulate_slices(fn: SliceLoss, params, batch, microbatches: int, api: str):
    """:func:`accumulate` for a module whose forward pass may write state."""
    one_pass = fn.target.trains_statistics and fn.options.batch_stats != "per_microbatch"
    if microbatches == 1 or one_pass:
        return fn(params, batch)
    threaded = fn.options.batch_stats == "per_microbatch"
    chunks = split_microbatches(batch, microbatches, api)
    rows = leading_size(batch) // microbatches

    def position(m):
        # Threaded: a plain loop over the micro-batches, each one device's own draw (the
        # counters advance); otherwise micro-batch m is block m of this slice's rows.
        return fn.position if threaded else fn.position.refine(m, microbatches)

    def run(state, m, chunk):
        (loss, res), g = fn.run(params, state, chunk, position(m))
        return loss, res, g

    loss0, res0, grads0 = run(fn.state, 0, jax.tree.map(lambda x: x[0], chunks))
    for field, what in (("aux", "auxiliary value"), ("new", "sown value")):
        if exact_leaves(getattr(res0, field), rows):
            check_batch_independent(lambda c, f=field: getattr(run(fn.state, 0, c)[1], f),
                                    chunks, rows, api=api, what=what)

    def body(carry, xs):
        state, grads = carry
        m, chunk = xs
        loss, res, g = run(state if threaded else fn.state, m, chunk)
        grads = jax.tree.map(lambda c, x: c + x.astype(c.dtype), grads, g)
        outs = (loss, res._replace(state=None if threaded else res.state))
        return (res.state if threaded else state, grads), outs

    first = (loss0, res0._replace(state=None if threaded else res0.state))
    init = (res0.state if threaded else fn.state, jax.tree.map(_wide, grads0))
    rest = (jnp.arange(1, microbatches), jax.tree.map(lambda x: x[1:], chunks))
    (state, grads), outs = jax.lax.scan(body, init, rest)
    loss, res = _stack(first, outs)
    checks = {name: ok.all() for name, ok in res.checks.items()}
    loss, aux, new = over_microbatches((loss, res.aux, res.new), microbatches, rows)
    if not threaded:
        state = over_microbatches(res.state, microbatches, rows, examples=False)
    grads = jax.tree.map(lambda g, like: (g / microbatches).astype(like.dtype), grads, grads0)
    return (loss, LocalResult(aux, state, new, checks)), grads
