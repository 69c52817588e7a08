"""A training state as Orbax sees it: a nested dict named by pytree path, and back.

Orbax stores a tree of nested dicts of arrays. A ``px.TrainState`` holds NNX states, optax
named tuples and static fields, so :func:`to_nested` names every array leaf by its pytree
path (``params/blocks/mlp/fc/kernel/value``, ``opt_state/0/mu/...``) and nests the names;
the Python classes stay out of the checkpoint. Restoring rebuilds the state from the tree
structure of ``like`` (:func:`abstract_state`), so the static parts (the model's graph, the
optimizer) come from the caller's code, and :func:`check_matches` names the first leaf where
the checkpoint and ``like`` differ.

Example:
  >>> import jax.numpy as jnp
  >>> nested = to_nested({"params": {"w": jnp.ones(2)}, "opt": (jnp.zeros(3),)}, "save")
  >>> {name: leaf.shape for name, leaf in flatten_nested(nested).items()}
  {('opt', '0'): (3,), ('params', 'w'): (2,)}
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx

Name = tuple[str, ...]


def leaf_name(path) -> Name:
    """The checkpoint name of a leaf: each key of its pytree path as a string."""
    parts = []
    for key in path:
        if isinstance(key, jax.tree_util.GetAttrKey):
            parts.append(key.name)
        elif isinstance(key, jax.tree_util.DictKey):
            parts.append(str(key.key))
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
        elif isinstance(key, jax.tree_util.FlattenedIndexKey):
            parts.append(str(key.key))
        else:
            parts.append(str(key))
    return tuple(parts)


def name_text(name: Name) -> str:
    """A checkpoint name in ``keystr`` notation (``['params']['w']``), for messages."""
    return "".join(f"[{part!r}]" for part in name)


def named_leaves(tree, api: str) -> tuple[list[tuple[Any, Name, Any]], Any]:
    """``[(path, name, leaf)]`` in leaf order, and the tree structure.

    Raises when two leaves get one name (dict keys ``1`` and ``"1"``) or the tree is one bare
    array (a checkpoint is a tree of named arrays).
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    named, seen = [], {}
    for path, leaf in flat:
        name = leaf_name(path)
        if not name:
            raise TypeError(f"{api}: the state is a single array; save a pytree of arrays "
                            "(a px.TrainState, (params, opt_state), or a dict).")
        if name in seen:
            raise ValueError(
                f"{api}: the leaves {jax.tree_util.keystr(seen[name])} and "
                f"{jax.tree_util.keystr(path)} get the same checkpoint name {name_text(name)}; "
                "give the containers distinct string keys.")
        seen[name] = path
        named.append((path, name, leaf))
    return named, treedef


def nest(pairs) -> dict:
    """A nested dict from ``[(name, value)]``: ``(("a", "b"), x)`` -> ``{"a": {"b": x}}``."""
    root: dict = {}
    for name, value in pairs:
        node = root
        for part in name[:-1]:
            node = node.setdefault(part, {})
        node[name[-1]] = value
    return root


def lookup(nested: dict, name: Name):
    """The value at ``name`` in a nested dict (what :func:`nest` built)."""
    node = nested
    for part in name:
        node = node[part]
    return node


def flatten_nested(nested) -> dict[Name, Any]:
    """``{name: leaf}`` for a nested dict (Orbax's metadata or a restored tree)."""
    flat = jax.tree_util.tree_flatten_with_path(nested, is_leaf=lambda x: not isinstance(x, dict))
    return {leaf_name(path): leaf for path, leaf in flat[0]}


def to_nested(state, api: str) -> dict:
    """The state as Orbax's tree: every array leaf under its path name."""
    named, _ = named_leaves(state, api)
    return nest((name, leaf) for _, name, leaf in named)


def abstract_state(like, api: str):
    """``like`` as an abstract state: run abstractly when it is a function, else its shapes.

    A function is traced with ``jax.eval_shape`` (NNX eager sharding off, as in ``px.init``);
    a state (concrete or abstract) gives each leaf's shape and dtype.
    """
    if isinstance(like, nnx.Module):
        raise TypeError(
            f"{api}: like must be the function given to px.init (or an abstract state), not "
            f"an nnx.Module ({type(like).__name__}); pass e.g. "
            "lambda: px.TrainState.create(model_fn(), tx).")
    if callable(like):
        with nnx.use_eager_sharding(False):
            return jax.eval_shape(like)

    def shape_of(path, leaf):
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            raise TypeError(
                f"{api}: like's leaf {jax.tree_util.keystr(path)} is a "
                f"{type(leaf).__name__}, not an array; pass the function given to px.init, "
                "or a state whose leaves are arrays or jax.ShapeDtypeStruct.")
        return jax.ShapeDtypeStruct(np.shape(leaf), leaf.dtype)

    return jax.tree_util.tree_map_with_path(shape_of, like)


def describe_leaf(leaf) -> str:
    """``float32[2,64]``: a leaf's dtype and shape for messages (``nothing`` when absent)."""
    if leaf is None:
        return "nothing"
    return f"{leaf.dtype}[{','.join(str(d) for d in leaf.shape)}]"


def _stored(leaf):
    """How Orbax stores a leaf: a typed PRNG key array as its raw key data."""
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        return jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
    return leaf


def _same(saved, wanted) -> bool:
    wanted = _stored(wanted)
    return tuple(saved.shape) == tuple(wanted.shape) and str(saved.dtype) == str(wanted.dtype)


def check_matches(saved: dict[Name, Any], wanted: list[tuple[Any, Name, Any]], api: str,
                  where: str) -> None:
    """Raises at the first leaf where the checkpoint (``saved``) and ``like`` differ.

    ``wanted`` is :func:`named_leaves` of the abstract ``like``; leaves are compared in its
    order (shape and dtype), then any leaf only the checkpoint has is named.
    """
    fix = _unfused_layout(saved) or (
        "Build `like` the way the saved state was built (same model sizes, same optimizer, "
        "same kind of state), or restore into that state and convert it.")
    for path, name, leaf in wanted:
        got = saved.get(name)
        if got is None or not _same(got, leaf):
            raise ValueError(
                f"{api}: the checkpoint {where} does not match `like` at "
                f"{jax.tree_util.keystr(path)}: the checkpoint holds {describe_leaf(got)}, "
                f"`like` expects {describe_leaf(leaf)}. {fix}")
    names = {name for _, name, _ in wanted}
    for name, got in saved.items():
        if name not in names:
            raise ValueError(
                f"{api}: the checkpoint {where} does not match `like` at {name_text(name)}: "
                f"the checkpoint holds {describe_leaf(got)}, `like` expects nothing. {fix}")


# Leaves of px.models' layout before their projections were fused (names, not imports: the
# checkpoint sits below the models): a checkpoint that holds one was saved by an older parallax.
_UNFUSED = (("attn", "key", "kernel"), ("mlp", "gate", "kernel"))


def _unfused_layout(saved: dict[Name, Any]) -> str | None:
    """The fix for a checkpoint of px.models' unfused layout, or None for any other."""
    found = [name for name in saved if any(
        name[i:i + 3] == old for old in _UNFUSED for i in range(len(name) - 2))]
    if not found:
        return None
    return (f"The checkpoint holds px.models' layout from before fused projections "
            f"({name_text(found[0])}: separate query/key/value kernels, or gate and up); "
            "this parallax keeps them fused (attn.qkv [D, 3, H, K] in the GPT, "
            "attn.key_value [D, 2, G, K] and mlp.gate_up [D, 2, F] in the Llama). Move the "
            "weights with px.models.save_pretrained in the parallax that saved it and "
            "px.models.from_pretrained here (the optimizer state starts anew); see "
            "docs/models.md.")


def restored_state(nested: dict, wanted: list[tuple[Any, Name, Any]], treedef):
    """Rebuilds the state with ``like``'s structure from Orbax's restored nested dict."""
    return jax.tree.unflatten(treedef, [lookup(nested, name) for _, name, _ in wanted])

