"""Checks at the boundary of ``px.init`` and ``px.train_step`` that JAX would answer raw.

Each check runs where it costs nothing on the normal path: at decoration or creation
(the step and init functions), in O(1) before a call (a state donated to an earlier call:
reusing its deleted buffers crashed simulated CPU devices with SIGSEGV), while ``jit``
traces (shapes), or only after ``jit`` has already failed (the state on another mesh, a
bare array indexed by name, a batch leaf whose rank changed since the last call), to put
a message that names the path, the shapes, the meshes and the fix in front of JAX's.
"""

from __future__ import annotations

import inspect

import jax
from jax.sharding import NamedSharding

from parallax.rules import is_array
from parallax.mesh import describe


def check_step_fn(fn, api: str = "px.train_step") -> None:
    """The decorated step must be a function ``step(state, batch, *args)``."""
    if not callable(fn):
        raise TypeError(
            f"{api}: decorate a function step(state, batch, *args) -> (state, metrics); got "
            f"{type(fn).__name__}: {fn!r}. Use it as @px.train_step(mesh, strategy) above a "
            "def.")


def check_init_fn(fn, api: str = "px.init") -> None:
    """``px.init`` takes a function of no arguments that returns the state."""
    if not callable(fn):
        kind = type(fn).__name__
        raise TypeError(
            f"{api}: the first argument must be a function of no arguments that builds the "
            f"state (px.init(lambda: px.TrainState.create(model, tx), mesh, strategy)); got "
            f"a {kind}. To place a state that already exists, use px.shard(state, mesh, "
            "strategy).")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: let the call decide
        return
    required = [p.name for p in signature.parameters.values()
                if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY,
                                                       p.POSITIONAL_OR_KEYWORD,
                                                       p.KEYWORD_ONLY)]
    if required:
        raise TypeError(
            f"{api}: the init function {getattr(fn, '__name__', fn)!r} takes the required "
            f"arguments {required}; px.init calls it with none. Bind them first: "
            "px.init(lambda: make_state(...), mesh, strategy).")


def check_init_result(out, api: str = "px.init") -> None:
    """The init function must return a pytree of arrays (at least one)."""
    leaves = jax.tree_util.tree_flatten_with_path(out, is_leaf=lambda x: x is None)[0]
    bad = [(p, x) for p, x in leaves if not is_array(x)]
    if out is None or not leaves:
        raise TypeError(
            f"{api}: the init function returned {out!r}, which holds no arrays; return the "
            "state (px.TrainState.create(model, tx), (params, opt_state), or a parameter "
            "tree).")
    if bad:
        path, leaf = bad[0]
        where = jax.tree_util.keystr(path) or "(the value itself)"
        raise TypeError(
            f"{api}: the init function returned a {type(leaf).__name__} at {where}; the "
            "state must be a pytree of arrays (static values belong in struct fields marked "
            "pytree_node=False).")


def donated_error(api: str = "px.train_step") -> ValueError:
    return ValueError(
        f"{api}: this state was donated to an earlier call (donate=True, the default): its "
        "buffers are deleted and now hold the next state. Use the state the step returned "
        "(state, metrics = step(state, batch)), or decorate with px.train_step(mesh, "
        "strategy, donate=False) to keep the input state usable.")


def check_state_mesh(state, mesh, api: str = "px.train_step") -> None:
    """Every committed state leaf must live on ``mesh``'s devices."""
    devices = set(mesh.devices.flat)
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        sharding = getattr(leaf, "sharding", None)
        # Only placed leaves: jit moves an uncommitted single-device array itself.
        if not isinstance(sharding, NamedSharding) or set(sharding.device_set) == devices:
            continue
        where = jax.tree_util.keystr(path) or "the state"
        other = describe(sharding.mesh)
        raise ValueError(
            f"{api}: the state leaf {where} lives on the mesh {other}, but this step runs on "
            f"{describe(mesh)}. Place the state for this mesh: px.shard(state, mesh, "
            "strategy) (or create it with px.init(..., mesh, strategy)).")


def batch_shapes(batch) -> dict[str, tuple]:
    """``{path: shape}`` of a batch's leaves (remembered from the last successful trace)."""
    return {jax.tree_util.keystr(p): tuple(getattr(x, "shape", ()))
            for p, x in jax.tree_util.tree_flatten_with_path(batch)[0]}


def explain_failure(batch, error: Exception, last_shapes: dict | None,
                    api: str = "px.train_step") -> None:
    """Raises parallax's message for an error ``jit`` or the step raised, when one fits."""
    if "memory_space of all inputs" in str(error):
        raise ValueError(
            f"{api}: the step computed with a value held in host memory (ZeRO-Offload, "
            "px.ZeRO(..., offload=...)) and one in device memory. px.train_step copies "
            "offloaded leaves to the device before the step, except a px.TrainState's "
            "optimizer state, which state.apply_gradients(grads) copies after the "
            "gradients exist; to use state.opt_state yourself, first call "
            "parallax.host_memory.to_device(state.opt_state). JAX said: "
            f"{str(error).splitlines()[0]}") from error
    if is_array(batch) and "string indexing" in str(error):
        raise TypeError(
            f"{api}: the batch is a bare array of shape {tuple(batch.shape)}, and the step "
            "indexes it by name (batch['x']); pass a dict of arrays, e.g. {'x': x, 'y': y}."
        ) from error
    if last_shapes:
        for where, shape in batch_shapes(batch).items():
            before = last_shapes.get(where)
            if before is not None and len(before) != len(shape):
                raise ValueError(
                    f"{api}: the batch leaf {where or '(the batch)'} has shape {shape}, rank "
                    f"{len(shape)}, but had shape {before} (rank {len(before)}) in the last "
                    f"call that worked; the step failed with: {error}") from error
