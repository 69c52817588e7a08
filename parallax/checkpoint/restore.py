"""``px.checkpoint.restore``: read a checkpoint straight into a strategy's layout on a mesh.

The state's shape comes from ``like`` (the function given to ``px.init``, run abstractly, or
an abstract state); its layout from ``parallax.layout.state_shardings`` for the strategy on
the mesh the run has now, which may differ from the one that saved it (another strategy,
another number of devices or processes, one device). Orbax is given a target sharding for
every leaf, so each device reads only its own shards from storage and no device ever holds
the whole state. The checkpoint's tree is compared with ``like`` first: a restore never
silently pads, truncates or casts a leaf.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import Mesh, SingleDeviceSharding

from parallax import layout
from parallax.checkpoint.extra import decode
from parallax.checkpoint.store import (
    CheckpointNotFoundError,
    check_step,
    checkpoint_path,
    open_manager,
    step_directory,
)
from parallax.checkpoint.tree import (
    abstract_state,
    check_matches,
    flatten_nested,
    named_leaves,
    nest,
    restored_state,
)
from parallax.step.placement import checked_strategy
from parallax.strategy import Strategy


class Restored(NamedTuple):
    """What a restore returns.

    Attributes:
      state: the training state, with ``like``'s structure, laid out as the strategy says
        on the mesh (on one device when there is no mesh).
      step: the step the checkpoint was saved as.
      extra: the ``extra`` dict saved with it (``{}`` when none was given).
    """

    state: Any
    step: int
    extra: dict


def target_shardings(abstract, mesh: Mesh | None, strategy: Strategy | None, api: str) -> list:
    """One sharding per leaf of ``abstract``: the strategy's layout, or one local device."""
    count = len(jax.tree.leaves(abstract))
    if mesh is None:
        if strategy is not None:
            raise ValueError(f"{api}: strategy={strategy.name} needs a mesh; pass "
                             "mesh=px.make_mesh(...), or neither mesh nor strategy to restore "
                             "on one device.")
        return [SingleDeviceSharding(jax.local_devices()[0])] * count
    if not isinstance(mesh, Mesh):  # None is allowed here: one device
        raise TypeError(f"{api}: mesh must be a jax.sharding.Mesh (px.make_mesh) or None "
                        f"(one device), got {type(mesh).__name__}.")
    strategy = checked_strategy(strategy, mesh, api)
    return jax.tree.leaves(layout.state_shardings(abstract, strategy, mesh, api))


def _unreadable(api: str, where, steps, err: Exception) -> ValueError:
    detail = (str(err).strip().splitlines() or [""])[0][:300]
    return ValueError(
        f"{api}: the checkpoint {where} cannot be read ({type(err).__name__}: {detail}); it is "
        f"damaged or incomplete. Restore another step of this directory (steps {steps}) "
        "with step=..., or save it again.")


def restore_from(manager: ocp.CheckpointManager, path: epath.Path, *, like, mesh, strategy,
                 step: int | None, api: str) -> Restored:
    """Restores a step through an open Orbax manager (see :func:`restore`)."""
    abstract = abstract_state(like, api)
    wanted, treedef = named_leaves(abstract, api)
    shardings = target_shardings(abstract, mesh, strategy, api)
    steps = sorted(manager.all_steps())
    if not steps:
        raise CheckpointNotFoundError(
            f"{api}: no checkpoint in {path}: it holds no complete step (a save that was "
            "interrupted leaves only a '<step>.orbax-checkpoint-tmp' directory, which is "
            "ignored).")
    if step is None:
        step = steps[-1]
    elif check_step(step, api) not in steps:
        raise CheckpointNotFoundError(f"{api}: no step {step} in {path}; its steps are {steps}.")
    where = step_directory(path, step)
    try:
        metadata = manager.item_metadata(step)["state"]
        saved = flatten_nested(metadata.tree)
    except Exception as err:  # Orbax and TensorStore raise many kinds; name the checkpoint
        raise _unreadable(api, where, steps, err) from err
    check_matches(saved, wanted, api, str(where))
    target = nest((name, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding))
                  for (_, name, leaf), sharding in zip(wanted, shardings, strict=True))
    try:
        out = manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), extra=ocp.args.JsonRestore()))
    except Exception as err:
        raise _unreadable(api, where, steps, err) from err
    return Restored(restored_state(out["state"], wanted, treedef), step, decode(out["extra"]))


def restore(directory, *, like, mesh: Mesh | None = None, strategy: Strategy | None = None,
            step: int | None = None) -> Restored:
    """Restores a checkpoint directly in the layout ``strategy`` gives on ``mesh``.

    Args:
      directory: the checkpoint directory (from ``px.checkpoint.save`` or ``Manager``).
      like: the function given to ``px.init`` (run abstractly: nothing is allocated), or an
        abstract or concrete state of the same structure. It supplies the static parts of
        the state (the model's graph, the optimizer) and every leaf's shape and dtype.
      mesh: the mesh to restore onto (any shape, any number of devices); None for one
        device.
      strategy: the layout on ``mesh`` (replicated when None); any strategy, not
        necessarily the one that saved.
      step: which step; the latest complete one when None.

    Returns:
      A :class:`Restored` ``(state, step, extra)``.

    Raises:
      CheckpointNotFoundError: no such directory, no complete step in it, or no such step.
      ValueError: the checkpoint's tree differs from ``like`` (the first differing path and
        both shapes are named), or it is damaged.

    Example:
      >>> import tempfile, jax, optax, parallax as px
      >>> from flax import nnx
      >>> make = lambda: px.TrainState.create(
      ...     px.models.MLP(4, [8], 4, rngs=nnx.Rngs(0)), optax.adam(1e-3))
      >>> state = px.init(make, px.make_mesh(data=8), px.FSDP("data"))
      >>> directory = tempfile.mkdtemp()
      >>> _ = px.checkpoint.save(directory, state, step=3, extra={"next_batch": 3})
      >>> mesh2 = px.make_mesh(data=2, devices=jax.devices()[:2])  # another mesh and strategy
      >>> state2, step, extra = px.checkpoint.restore(
      ...     directory, like=make, mesh=mesh2, strategy=px.ZeRO(1, "data"))
      >>> step, extra, state2.opt_state[0].mu["layers"][0]["kernel"][...].sharding.spec
      (3, {'next_batch': 3}, P(None, 'data'))

    References:
      Orbax (``orbax.checkpoint``): restore with target shardings; flax issue 5110 (a lost
      target sharding silently restores the saved layout, which parallax never does).
    """
    api = "px.checkpoint.restore"
    path = checkpoint_path(directory, api)
    if not path.exists():
        raise CheckpointNotFoundError(
            f"{api}: no checkpoint directory {path}: it does not exist. Pass the directory "
            "given to px.checkpoint.save or px.checkpoint.Manager.")
    manager = open_manager(path, read_only=True)
    try:
        return restore_from(manager, path, like=like, mesh=mesh, strategy=strategy, step=step,
                            api=api)
    finally:
        manager.close()
