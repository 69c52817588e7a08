"""Micro-batches: split a batch into equal slices and accumulate their gradients.

The mechanism that gradient accumulation (``px.GradientAccumulation``,
``px.value_and_grad(microbatches=k)``) and the pipelines (``parallax.pipeline``) share: a
check that a batch splits, the split itself, and a ``lax.scan`` that sums each micro-batch's
loss, aux values and gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp



def check_microbatches(batch, microbatches: int, api: str, shards: int = 1) -> None:
    """Each of the ``shards`` slices of every batch leaf must split into ``microbatches``."""
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"{api}: microbatches={microbatches!r} must be a positive int.")
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


def split_microbatches(batch, microbatches: int, api: str):
    """Reshapes every batch leaf ``[B, ...]`` to ``[microbatches, B // microbatches, ...]``."""
    check_microbatches(batch, microbatches, api)
    return jax.tree.map(
        lambda x: x.reshape(microbatches, x.shape[0] // microbatches, *x.shape[1:]), batch
    )


def accumulate(value_and_grad_fn, params, batch, microbatches: int, *, api="px.value_and_grad"):
    """Mean loss, aux and gradients over micro-batches, with a ``lax.scan``.

    ``value_and_grad_fn(params, batch) -> ((loss, aux), grads)``. The loss must be a mean
    over examples, so the mean over equal micro-batches is the full batch's value. Gradients
    accumulate in float32 (or the gradient's dtype when wider) and are cast back at the end.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> f = jax.value_and_grad(lambda w, b: (jnp.mean(b @ w), None), has_aux=True)
      >>> (loss, _), g = accumulate(f, jnp.ones(3), jnp.ones((8, 3)), 4)
      >>> float(loss)
      3.0
    """
    if microbatches == 1:
        return value_and_grad_fn(params, batch)
    chunks = split_microbatches(batch, microbatches, api)

    def wide(x):
        if jnp.issubdtype(x.dtype, jnp.floating):
            return x.astype(jnp.promote_types(x.dtype, jnp.float32))
        return x

    # The first micro-batch seeds the sums: its values already have the right types, including
    # which mesh axes they vary over inside shard_map, which zeros would not.
    first = value_and_grad_fn(params, jax.tree.map(lambda x: x[0], chunks))
    (loss0, aux0), grads0 = first
    init = jax.tree.map(wide, (loss0, aux0, grads0))

    def body(carry, chunk):
        (loss, aux), grads = value_and_grad_fn(params, chunk)
        return jax.tree.map(lambda c, x: c + x.astype(c.dtype), carry, (loss, aux, grads)), None

    rest = jax.tree.map(lambda x: x[1:], chunks)
    (loss, aux, grads), _ = jax.lax.scan(body, init, rest)

    def mean(total, like):
        if jnp.issubdtype(like.dtype, jnp.floating):
            return (total / microbatches).astype(like.dtype)
        return total.astype(like.dtype)  # integer aux (counts) are summed

    loss, aux, grads = jax.tree.map(mean, (loss, aux, grads), (loss0, aux0, grads0))
    return (loss, aux), grads
