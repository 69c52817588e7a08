"""``px.checkpoint.save``: write a sharded training state (and ``extra``) with Orbax.

Every process calls it with the same arguments; each writes the shards its devices hold
(one replica of each), and Orbax's primary process commits the step when all are done, so
the same call saves from one device, eight simulated ones or many hosts. The state is
checked before anything touches the disk: every leaf an array, none donated to a train step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from parallax.checkpoint.extra import encode
from parallax.checkpoint.store import check_step, checkpoint_path, open_manager, step_directory
from parallax.checkpoint.tree import named_leaves, nest


def _leaf(path, leaf, api: str):
    where = jax.tree_util.keystr(path)
    if isinstance(leaf, jax.Array):
        if leaf.is_deleted():
            raise ValueError(
                f"{api}: the state's leaf {where} was deleted: it was donated to a train "
                "step (px.train_step donates its state argument). Save the state the step "
                "returned.")
        return leaf
    if isinstance(leaf, np.ndarray):
        return leaf
    if isinstance(leaf, (int, float, bool, np.generic)):
        return np.asarray(leaf)
    raise TypeError(
        f"{api}: the state's leaf {where} is a {type(leaf).__name__}, not an array; a "
        "checkpoint holds arrays (jax.Array or numpy). Save a state from px.init or a train "
        "step, and put other values in extra.")


def save_args(state, extra: Mapping[str, Any] | None, api: str) -> ocp.args.Composite:
    """Orbax's arguments for ``state`` and ``extra``, checked (nothing is written here)."""
    named, _ = named_leaves(state, api)
    if not named:
        raise ValueError(f"{api}: the state has no arrays to save.")
    if extra is not None and not isinstance(extra, Mapping):
        raise TypeError(f"{api}: extra must be a dict (JSON values, arrays, PRNG keys) or "
                        f"None, got {type(extra).__name__}.")
    arrays = nest((name, _leaf(path, leaf, api)) for path, name, leaf in named)
    return ocp.args.Composite(state=ocp.args.StandardSave(arrays),
                              extra=ocp.args.JsonSave(encode(dict(extra or {}), api)))


def commit(manager: ocp.CheckpointManager, path: epath.Path, step: int,
           args: ocp.args.Composite, api: str) -> None:
    """Starts saving ``args`` as ``step`` through ``manager``; never overwrites a step."""
    if step_directory(path, step).exists() or step in manager.all_steps():
        raise ValueError(
            f"{api}: step {step} already exists in {path}; a checkpoint is never "
            "overwritten. Save under another step, or delete that step directory yourself.")
    manager.save(step, args=args, force=True)


def save(directory, state, *, step: int, extra: Mapping[str, Any] | None = None) -> epath.Path:
    """Saves ``state`` (any sharding, any mesh) and ``extra`` as step ``step`` of ``directory``.

    Synchronous and atomic: when it returns, ``directory/<step>`` is complete; if the
    process dies first, no step directory appears and earlier steps are untouched. Call it
    on every process.

    Args:
      directory: the checkpoint directory (created when missing; other files in it are left
        alone).
      state: a ``px.TrainState``, a ``(params, opt_state)`` tuple, or any pytree of arrays.
      step: the step number (an int >= 0) that names the checkpoint.
      extra: what a resume needs besides the state: the data position, RNG state, the run's
        settings (JSON values, NumPy/JAX arrays, JAX PRNG keys; see
        ``parallax.checkpoint.extra``).

    Returns:
      The step's directory.

    Example:
      >>> import tempfile, optax, parallax as px
      >>> from flax import nnx
      >>> mesh, strategy = px.make_mesh(data=2, fsdp=4), px.HSDP("data", "fsdp")
      >>> make = lambda: px.TrainState.create(
      ...     px.models.MLP(4, [8], 4, rngs=nnx.Rngs(0)), optax.adam(1e-3))
      >>> state = px.init(make, mesh, strategy)
      >>> directory = tempfile.mkdtemp()
      >>> px.checkpoint.save(directory, state, step=10, extra={"next_batch": 10}).name
      '10'

    References:
      Orbax (``orbax.checkpoint.CheckpointManager``), the checkpoint library of JAX.
    """
    api = "px.checkpoint.save"
    path = checkpoint_path(directory, api)
    step = check_step(step, api)
    args = save_args(state, extra, api)  # a bad state is refused before the disk is touched
    manager = open_manager(path)
    try:
        commit(manager, path, step, args, api)
    finally:
        manager.close()
    return step_directory(path, step)
