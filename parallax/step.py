"""``px.init``, ``px.shard`` and ``@px.train_step``: sharded state and jitted SPMD steps."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from parallax import batch as batch_lib
from parallax import context, layout
from parallax.mesh import describe
from parallax.strategy import Strategy


def _strategy(strategy: Strategy | None, mesh: Mesh, api: str) -> Strategy:
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
    one device. NNX's eager sharding is turned off while ``fn`` runs (the layout comes from
    the strategy, not from the variables).

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
    strategy = _strategy(strategy, mesh, "px.init")
    # Each call of ``fn`` may build new static parts (a fresh optax optimizer compares
    # unequal to the last one), so the shardings are passed as a flat list and the result is
    # rebuilt with the tree structure of the call that produced it.
    structure = []

    def flat():
        leaves, treedef = jax.tree.flatten(fn())
        structure.append(treedef)
        return leaves

    with nnx.use_eager_sharding(False):
        abstract = jax.eval_shape(fn)
        specs = layout.state_layout(abstract, strategy, mesh, "px.init").specs
        with jax.set_mesh(mesh):
            leaves = jax.jit(flat, out_shardings=[NamedSharding(mesh, s) for s in specs])()
    return jax.tree.unflatten(structure[-1], leaves)


def shard(tree, mesh: Mesh, strategy: Strategy | None = None):
    """Places an existing state (or parameter tree) on ``mesh`` in the strategy's layout.

    Example:
      >>> import jax.numpy as jnp, parallax as px
      >>> params = px.shard({"w": jnp.ones((8, 4))}, px.make_mesh(data=-1), px.FSDP("data"))
      >>> params["w"].sharding.spec
      P('data',)
    """
    strategy = _strategy(strategy, mesh, "px.shard")
    return jax.device_put(tree, layout.state_shardings(tree, strategy, mesh, "px.shard"))


class TrainStep:
    """A user's ``step(state, batch, *args) -> (state, metrics)``, jitted for a mesh.

    Calling it runs one ``jax.jit``-ed SPMD program: the state keeps the layout it was
    created in (``px.init``) and comes back in the strategy's layout, donated (updated in
    place); the batch is split over the strategy's batch axes. ``lower(...)`` returns
    ``jax.jit``'s ``Lowered`` so the compiled program can be inspected
    (``.compile().as_text()``, ``.memory_analysis()``).

    A call costs what ``jax.jit``'s dispatch costs and nothing of parallax's own: the jitted
    function is built once, ``jax.jit``'s C++ cache keys each call on the arguments' tree
    structure, shapes, dtypes and shardings, and parallax's checks (the batch against the
    strategy, the returned state's structure) and layout run while ``jit`` traces, that is
    only when a new signature makes it retrace.
    """

    def __init__(self, fn: Callable, mesh: Mesh, strategy: Strategy, donate: bool):
        self.fn, self.mesh, self.strategy, self.donate = fn, mesh, strategy, donate
        self._context = context.StepContext(mesh, strategy)
        self._multiprocess = jax.process_count() > 1
        # The state keeps its own (committed) shardings on the way in, and is constrained to
        # the strategy's layout on the way out; every batch leaf gets the one batch sharding.
        self._jitted = jax.jit(
            self._traced,
            in_shardings=(None, batch_lib.batch_sharding(strategy, mesh)),
            donate_argnums=(0,) if donate else (),
        )
        functools.update_wrapper(self, fn)

    def state_shardings(self, state):
        """The ``NamedSharding`` of every leaf of ``state`` under the strategy."""
        return layout.state_shardings(state, self.strategy, self.mesh, "px.train_step")

    def _traced(self, state, batch, *args):
        """The step as ``jit`` traces it: checks, the strategy's context, the layout."""
        self._check(batch)
        state_sh = self.state_shardings(state)
        with context.activate(self._context):
            out = self.fn(state, batch, *args)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(
                f"px.train_step: {getattr(self.fn, '__name__', 'the step')} must "
                f"return (state, metrics); it returned {type(out).__name__}."
            )
        new_state, metrics = out
        if jax.tree.structure(new_state) != jax.tree.structure(state):
            raise TypeError(
                "px.train_step: the state returned by the step has a different "
                f"structure from the state passed in:\n  in:  {jax.tree.structure(state)}\n  "
                f"out: {jax.tree.structure(new_state)}"
            )
        return jax.lax.with_sharding_constraint(new_state, state_sh), metrics

    def __call__(self, state, batch, *args):
        if self._multiprocess:
            batch = batch_lib.assemble(batch, self.strategy, self.mesh)
        try:
            with jax.set_mesh(self.mesh):
                return self._jitted(state, batch, *args)
        except (TypeError, ValueError) as error:
            # jit checks the arguments against their shardings before tracing, with
            # messages about pjit; parallax's own checks say what is wrong and the fix.
            self._check(batch)
            raise error

    def _check(self, batch) -> None:
        """The checks that run at trace time, for errors ``jit`` raises before tracing."""
        batch_lib.check_batch(batch, self.strategy, self.mesh, "px.train_step")

    def lower(self, state, batch, *args):
        """``jax.jit(...).lower``: the program this step runs, before compilation.

        The state's shardings are the strategy's here (not the arguments' own), so an
        abstract state (``jax.ShapeDtypeStruct`` without shardings) lowers to the program a
        real call runs.
        """
        if self._multiprocess:
            batch = batch_lib.assemble(batch, self.strategy, self.mesh)
        jitted = jax.jit(
            self._traced,
            in_shardings=(self.state_shardings(state), batch_lib.batch_sharding(
                self.strategy, self.mesh)),
            donate_argnums=(0,) if self.donate else (),
        )
        with jax.set_mesh(self.mesh):
            return jitted.lower(state, batch, *args)

    def __repr__(self) -> str:
        return (f"px.train_step({getattr(self.fn, '__name__', 'step')}, "
                f"mesh={describe(self.mesh)}, strategy={self.strategy.name})")


def train_step(mesh: Mesh, strategy: Strategy | None = None, *, donate: bool = True):
    """Decorates ``step(state, batch, *args) -> (state, metrics)`` as a jitted SPMD step.

    Inside the step the strategy is active: ``px.value_and_grad`` produces and synchronises
    gradients as it says, and ``px.constrain`` resolves activation names through its rules.

    Args:
      mesh: the device mesh.
      strategy: how to lay out state and batch and synchronise gradients; replicated when
        None.
      donate: donate the input state's buffers to the output (the default; the old state
        must not be used after the call).

    Returns:
      A decorator producing a :class:`TrainStep`.

    Example:
      >>> import jax.numpy as jnp, optax, parallax as px
      >>> from flax import nnx
      >>> mesh, strategy = px.make_mesh(data=-1), px.DataParallel("data")
      >>> state = px.init(lambda: px.TrainState.create(
      ...     px.models.MLP(4, [8], 2, rngs=nnx.Rngs(0)), optax.sgd(0.1)), mesh, strategy)
      >>> @px.train_step(mesh, strategy)
      ... def step(state, batch):
      ...     loss, grads = px.value_and_grad(px.models.mse_loss)(state.model, batch)
      ...     return state.apply_gradients(grads), {"loss": loss}
      >>> batch = {"x": jnp.ones((16, 4)), "y": jnp.zeros((16, 2))}
      >>> state, metrics = step(state, batch)
    """
    strategy = _strategy(strategy, mesh, "px.train_step")

    def decorator(fn: Callable) -> TrainStep:
        return TrainStep(fn, mesh, strategy, donate)

    return decorator
