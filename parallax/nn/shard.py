"""The explicit style: run a ``parallax.nn`` model inside ``shard_map`` over the tensor axis.

``tensor_parallel(loss_fn)`` wraps a loss function so that its model runs with each rank's
shard of the parameters and the layers issue Megatron's ``f``/``g`` operators themselves.
The parameters keep their global shapes and logical names everywhere else, so the same
state is created by ``px.init`` and stepped by ``px.train_step`` under
``px.TensorParallel``'s rules, composed with data parallelism or ZeRO as usual:

.. code-block:: python

    strategy = px.compose(px.DataParallel("data"), px.TensorParallel("tensor"))

    @px.train_step(mesh, strategy)
    def step(state, batch):
        loss_fn = px.nn.tensor_parallel(px.nn.parallel_next_token_loss)
        loss, grads = px.value_and_grad(loss_fn)(state.model, batch)
        return state.apply_gradients(grads), {"loss": loss}

``px.value_and_grad`` opens its ``shard_map`` over the batch axes; the wrapper opens a
nested one over the tensor axis. The gradients come back sharded like the parameters.
Outside a step, with no ``mesh=``, the wrapper calls ``loss_fn`` directly: one device.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jax.sharding import PartitionSpec as P

from parallax import context
from parallax.rules import annotated_leaves, readable_path
from parallax.strategies.tensor import TensorParallel, sharded_dims


def _leaf_specs(params, mesh, axis: str, rules, api: str) -> list[P]:
    size = mesh.shape[axis]
    specs = []
    for leaf in annotated_leaves(params):
        shape = tuple(getattr(leaf.leaf, "shape", ()))
        if leaf.names is None or leaf.physical:
            specs.append(P(*([None] * len(shape))))
            continue
        split = sharded_dims(leaf.names, shape, axis, size, rules,
                             path=readable_path(leaf.path), api=api)
        specs.append(P(*(axis if s else None for s in split)))
    return specs


def param_specs(params, mesh, axis: str = "tensor", *, rules=None):
    """``shard_map`` in_specs for a parameter tree: its tensor-parallel dimensions on ``axis``.

    Args:
      params: a parameter tree with logical names (``nnx.state(model, nnx.Param)``).
      mesh: the mesh (for the size of ``axis``).
      axis: the tensor-parallel mesh axis.
      rules: logical name -> mesh axes (default: ``px.TensorParallel(axis)``'s rules).

    Returns:
      A list of ``PartitionSpec``, one per leaf of ``jax.tree.leaves(params)``.

    Raises:
      ValueError: heads, MLP width or vocabulary do not split over ``axis`` (with the fix).

    Example:
      >>> import jax, parallax as px, parallax.nn
      >>> from flax import nnx
      >>> mlp = px.nn.ParallelMLP(8, 32, rngs=nnx.Rngs(0))
      >>> px.nn.param_specs(nnx.state(mlp, nnx.Param), px.make_mesh(tensor=-1))
      [P('tensor',), P(None, 'tensor'), P(None,), P('tensor', None)]
    """
    rules = dict(TensorParallel(axis).rules) if rules is None else dict(rules)
    return _leaf_specs(params, mesh, axis, rules, "px.nn.param_specs")


def tensor_parallel(loss_fn: Callable, axis: str = "tensor", *, mesh=None,
                    has_aux: bool = False) -> Callable:
    """Runs ``loss_fn(model, batch, *args)`` inside ``shard_map`` over ``axis`` (explicit TP).

    Differentiating the result (``px.value_and_grad``, ``jax.grad``) differentiates
    *inside* the ``shard_map``, through the layers' ``f``/``g`` operators: the parameter
    gradients are computed with the loss, as Megatron does, and scaled by the incoming
    cotangent. (JAX 0.10 cannot differentiate a ``shard_map`` nested in the one
    ``px.value_and_grad`` opens over the batch axes: the residuals' specs would name the
    outer axes. Differentiating inside sidesteps it and gives the same program.)

    Args:
      loss_fn: a loss of an NNX module built from ``parallax.nn`` layers (or of a parameter
        tree); it must return values that are the same on every tensor rank (a
        vocabulary-parallel loss is).
      axis: the tensor-parallel mesh axis.
      mesh: the mesh to use outside ``px.train_step`` (inside, the step's mesh is used).
      has_aux: ``loss_fn`` returns ``(loss, aux)``; ``aux`` is not differentiated.

    Returns:
      ``wrapped(model, batch, *args)`` with ``loss_fn``'s result, differentiable with
      respect to the model's ``nnx.Param`` state (the batch and ``args`` are constants).
      Inside ``px.train_step`` the parameter shards follow the step's strategy (its rules
      restricted to ``axis``); outside, ``px.TensorParallel(axis)``'s rules. The batch and
      the other arguments are replicated over ``axis``. With neither a step nor ``mesh``
      it is ``loss_fn`` itself.

    Raises:
      ValueError: a parameter's heads, MLP width or vocabulary do not split over ``axis``.

    Example:
      >>> import jax, jax.numpy as jnp, parallax as px, parallax.nn
      >>> from flax import nnx
      >>> mlp = px.nn.ParallelMLP(8, 32, rngs=nnx.Rngs(0))
      >>> loss = lambda m, x: jnp.mean(m(x) ** 2)
      >>> mesh = px.make_mesh(tensor=4, devices=jax.devices()[:4])
      >>> explicit = px.nn.tensor_parallel(loss, mesh=mesh)
      >>> x = jnp.ones((2, 5, 8))
      >>> bool(jnp.allclose(jax.jit(explicit)(mlp, x), loss(mlp, x), rtol=1e-5))
      True
    """

    def wrapped(model, batch, *args):
        ctx = context.current()
        where = ctx.mesh if ctx is not None else mesh
        if where is None or axis not in where.shape or (ctx and axis in ctx.manual_axes):
            return loss_fn(model, batch, *args)
        rules = ctx.strategy.rule_table if ctx is not None else dict(TensorParallel(axis).rules)
        if isinstance(model, nnx.Module):
            graphdef, params, rest = nnx.split(model, nnx.Param, ...)
            rebuild = lambda p, r: nnx.merge(graphdef, p, r)  # noqa: E731
        else:
            params, rest, rebuild = model, (), (lambda p, r: p)
        leaves, treedef = jax.tree.flatten(params)
        specs = _leaf_specs(params, where, axis, rules, "px.nn.tensor_parallel")

        def local(leaves, rest, batch, args):
            with context.manual((axis,)):
                out = loss_fn(rebuild(jax.tree.unflatten(treedef, leaves), rest), batch, *args)
            return out if has_aux else (out, None)

        def value_and_grads(leaves, rest, batch, args):
            return jax.value_and_grad(local, has_aux=True)(leaves, rest, batch, args)

        def mapped(fn, out_specs):
            return jax.shard_map(fn, mesh=None if ctx is not None else where,
                                 in_specs=(specs, P(), P(), P()), out_specs=out_specs,
                                 axis_names=frozenset({axis}))

        @jax.custom_vjp
        def run(leaves, rest, batch, args):
            return mapped(local, (P(), P()))(leaves, rest, batch, args)

        def run_fwd(leaves, rest, batch, args):
            out, grads = mapped(value_and_grads, ((P(), P()), specs))(leaves, rest, batch, args)
            return out, grads

        def run_bwd(grads, ct):
            scale = ct[0]
            return [jnp.asarray(scale * g, g.dtype) for g in grads], None, None, None

        run.defvjp(run_fwd, run_bwd)
        loss, aux = run(leaves, rest, batch, args)
        return (loss, aux) if has_aux else loss

    return wrapped
