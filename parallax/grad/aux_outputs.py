"""Values a loss returns besides the loss, reduced over batch shards and micro-batches by kind.

``px.value_and_grad`` computes a loss on slices of the batch (one per device in the
explicit style, one per micro-batch) and must hand back what one device computing the
whole batch would have. For the auxiliary values of ``has_aux``, the module state a forward
pass changes, and the values it ``sow``s, that depends on the kind of each leaf:

==================================  ================================================
kind                                reduction
==================================  ================================================
per-example array (leading          concatenated along the batch, in batch order: one
dimension = the slice's examples)   device's array over the whole batch
other floating array (a mean)       averaged (the mean of equal slices' means is the
                                    whole batch's mean); kept as is when every slice
                                    holds the same value
integer, bool, PRNG key             passed through when every slice holds the same
                                    value; rejected with a message when it differs
non-array (str, Python number)      passed through (it cannot depend on the data)
==================================  ================================================

Nothing is summed blindly: a count is ambiguous (a sum? the same on every shard?), so an
integer that differs between shards is an error that says how to return it.

Example:
  >>> import jax.numpy as jnp
  >>> arrays, statics = partition_static({"acc": jnp.float32(0.5), "name": "cnn"})
  >>> arrays
  {'acc': Array(0.5, dtype=float32), 'name': None}
  >>> restore_static(arrays, statics)
  {'acc': Array(0.5, dtype=float32), 'name': 'cnn'}
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from parallax.grad.sliced_rng import is_key, is_sliced, unsliced_key
from parallax.rules import is_array, readable_path
from parallax.comm.varying import to_varying, varying_axes


def partition_static(tree):
    """``(arrays, statics)``: ``tree`` with its non-array leaves replaced by None, and what
    :func:`restore_static` needs to put them back (the tree's structure and those leaves)."""
    leaves, treedef = jax.tree.flatten(tree)
    values = {i: x for i, x in enumerate(leaves) if not is_array(x)}
    arrays = [None if i in values else x for i, x in enumerate(leaves)]
    return jax.tree.unflatten(treedef, arrays), (treedef, values)


def restore_static(arrays, statics):
    """The inverse of :func:`partition_static` (on ``arrays`` reduced leaf by leaf)."""
    treedef, values = statics
    if treedef.num_leaves == 0:
        return jax.tree.unflatten(treedef, [])
    flat = jax.tree.leaves(arrays, is_leaf=lambda x: x is None)
    return jax.tree.unflatten(treedef, [values.get(i, x) for i, x in enumerate(flat)])


def kind(x, rows: int) -> str:
    """``"example"``, ``"float"``, ``"exact"`` (integer, bool) or ``"key"``."""
    if is_key(x):
        return "key"
    if getattr(x, "ndim", 0) >= 1 and x.shape[0] == rows:
        return "example"
    return "float" if jnp.issubdtype(x.dtype, jnp.inexact) else "exact"


def _differs(what: str, path, x, axes, api: str) -> ValueError:
    where = readable_path(path) or "(the value itself)"
    return ValueError(
        f"{api}: the {what} {where} ({x.dtype}{list(x.shape)}) differs between batch shards "
        f"{tuple(axes)}, and a value of this kind has no one-device reduction: return a "
        "float mean (e.g. jnp.mean(correct.astype(jnp.float32))) to have it averaged, or "
        "per-example values (leading dimension = the batch) to have them concatenated.")


def split_examples(tree, rows: int, axes: tuple[str, ...] = ()):
    """``(shared, examples)``: two trees like ``tree``, per-example leaves in the second,
    every other leaf in the first (None in the other's place).

    Inside ``shard_map`` over the batch ``axes``, a leaf that varies over none of them is
    the same on every shard (a statistic already summed over the batch, such as an MoE
    router's ``[layers, experts]`` load), so it is shared even when its leading dimension
    happens to equal ``rows``."""
    def example(x):
        if kind(x, rows) != "example":
            return False
        return not axes or bool(varying_axes(x) & set(axes))

    shared = jax.tree.map(lambda x: None if example(x) else x, tree)
    examples = jax.tree.map(lambda x: x if example(x) else None, tree)
    return shared, examples


def join_examples(shared, examples):
    """The inverse of :func:`split_examples`."""
    return jax.tree.map(lambda s, e: e if s is None else s, shared, examples,
                        is_leaf=lambda x: x is None)


def over_shards(tree, axes: tuple[str, ...], shards: int, *, api: str, what: str):
    """Non-per-example leaves reduced over the batch ``axes`` (inside ``shard_map``).

    Floats that vary are averaged; everything else must be the same on every shard.
    Per-example leaves are concatenated by ``shard_map``'s batch-sharded output instead.
    """

    def one(path, x):
        if is_sliced(x):
            x = unsliced_key(x)
        varies = bool(varying_axes(x) & set(axes))
        if not varies:
            return x
        if is_key(x) or not jnp.issubdtype(x.dtype, jnp.inexact):
            raise _differs(what, path, x, axes, api)
        return lax.psum(to_varying(x, axes), axes) / shards

    return jax.tree_util.tree_map_with_path(one, tree)


def over_microbatches(stacked, microbatches: int, rows: int, *, examples: bool = True):
    """Leaves stacked over micro-batches (``[k, ...]``) reduced to one device's value.

    Per-example leaves (``[k, rows, ...]``; none when ``examples`` is False, as for a
    module's own state, whose shapes never depend on the batch) are concatenated, floats
    averaged (in float32 or wider), integers, bools and keys taken from the last
    micro-batch: they do not depend on the data (:func:`check_batch_independent` refuses
    those that do), so they are the same for every micro-batch, or, with the state threaded
    through the micro-batches, the last is the one after the whole batch.
    """

    def one(x):
        if examples and x.ndim >= 2 and x.shape[1] == rows:
            return x.reshape(microbatches * rows, *x.shape[2:])
        if not is_key(x) and jnp.issubdtype(x.dtype, jnp.inexact):
            wide = jnp.promote_types(x.dtype, jnp.float32)
            return jnp.mean(x.astype(wide), axis=0).astype(x.dtype)
        return x[-1]

    return jax.tree.map(one, stacked)


def exact_leaves(tree, rows: int) -> list[tuple]:
    """``(path, leaf)`` of the integer, bool and key leaves that are not per-example."""
    return [(p, x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
            if kind(x, rows) in ("exact", "key")]


def check_batch_independent(aux_fn, chunks, rows: int, *, api: str, what: str) -> None:
    """Raises when an integer or key leaf of ``aux_fn(chunk)`` depends on the micro-batch.

    Traced abstractly (at trace time only, and only when such leaves exist) with the
    micro-batch axis as a ``vmap`` axis: a leaf computed from the data is batched over it,
    which ``out_axes=None`` refuses.
    """
    first = jax.tree.map(lambda x: x[0], chunks)
    paths = [p for p, _ in exact_leaves(jax.eval_shape(aux_fn, first), rows)]

    def exact_of(chunk):
        return [x for _, x in exact_leaves(aux_fn(chunk), rows)]

    for i, path in enumerate(paths):
        try:
            jax.eval_shape(jax.vmap(lambda c, i=i: exact_of(c)[i], out_axes=None), chunks)
        except ValueError:
            raise ValueError(
                f"{api}: the {what} {readable_path(path) or '(the value itself)'} is an "
                "integer, bool or key that depends on the micro-batch, and a value of this "
                "kind has no one-device reduction: return a float mean to have it averaged, "
                "or per-example values (leading dimension = the batch) to have them "
                "concatenated.") from None
