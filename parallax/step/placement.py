"""Placing state on the mesh: ``px.init`` creates it sharded, ``px.shard`` moves an existing
one into the strategy's layout; both check the strategy against the mesh first."""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx
from jax.sharding import Mesh

from parallax import layout
from parallax.step import boundary_checks as guards
from parallax.strategy import Strategy

def checked_strategy(strategy: Strategy | None, mesh: Mesh, api: str) -> Strategy:
    """``strategy`` (replicated when None), checked to be a Strategy whose axes ``mesh`` has."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"{api}: mesh must be a jax.sharding.Mesh (px.make_mesh), got "
                        f"{type(mesh).__name__}.")
    strategy = Strategy() if strategy is None else strategy
    if not isinstance(strategy, Strategy):
        raise TypeError(f"{api}: strategy must be a px.Strategy (px.DataParallel(...), "
                        f"px.compose(...)), got {type(strategy).__name__}.")
    strategy.validate(mesh, api)
    return strategy


def init(fn: Callable, mesh: Mesh, strategy: Strategy | None = None):
    """Creates a training state directly in its sharded layout.

    ``fn`` is traced once abstractly (``jax.eval_shape``) to find every leaf's shape and
    logical axes, then run under ``jax.jit`` with those shardings as ``out_shardings``, so
    each device materialises only its own shards: no full copy of the model ever lives on
    one device (and a leaf ZeRO-Offload keeps in host memory is created there). NNX's eager
    sharding is turned off while ``fn`` runs (the layout comes from the strategy, not from
    the variables).

    Args:
      fn: a function of no arguments returning the state (``px.TrainState.create(...)``,
        ``(params, opt_state)``, or a parameter tree).
      mesh: the device mesh.
      strategy: the strategy; replicated when None.

    Returns:
      The state, every leaf a ``jax.Array`` sharded as the strategy says.

    Example:
      >>> import optax, parallax as px
      >>> from flax import nnx
      >>> mesh = px.make_mesh(data=-1)
      >>> state = px.init(lambda: px.TrainState.create(
      ...     px.models.MLP(4, [8], 2, rngs=nnx.Rngs(0)), optax.adam(1e-3)),
      ...     mesh, px.ZeRO(1, "data"))
    """
    strategy = checked_strategy(strategy, mesh, "px.init")
    guards.check_init_fn(fn)
    # Each call of ``fn`` may build new static parts (a fresh optax optimizer compares
    # unequal to the last one), so the shardings are passed as a flat list and the result is
    # rebuilt with the tree structure of the call that produced it.
    structure = []

    def checked():
        out = fn()
        guards.check_init_result(out)
        return out

    def flat():
        leaves, treedef = jax.tree.flatten(fn())
        structure.append(treedef)
        return leaves

    with nnx.use_eager_sharding(False):
        abstract = jax.eval_shape(checked)
        shardings = layout.state_layout(abstract, strategy, mesh, "px.init").shardings(mesh)
        with jax.set_mesh(mesh):
            leaves = jax.jit(flat, out_shardings=shardings)()
    return jax.tree.unflatten(structure[-1], leaves)


def shard(tree, mesh: Mesh, strategy: Strategy | None = None):
    """Places an existing state (or parameter tree) on ``mesh`` in the strategy's layout.

    Example:
      >>> import jax.numpy as jnp, parallax as px
      >>> params = px.shard({"w": jnp.ones((8, 4))}, px.make_mesh(data=-1), px.FSDP("data"))
      >>> params["w"].sharding.spec
      P('data',)
    """
    strategy = checked_strategy(strategy, mesh, "px.shard")
    return jax.device_put(tree, layout.state_shardings(tree, strategy, mesh, "px.shard"))
