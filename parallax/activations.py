"""Activation sharding: ``px.constrain``, logical names that the step's strategy maps."""

from __future__ import annotations

import jax

from parallax import context
from parallax.rules import Names, resolve_spec


def constrain(x: jax.Array, names: Names) -> jax.Array:
    """Constrains an activation's sharding by logical names, under the active strategy.

    Outside ``px.train_step`` this is the identity, so a model that calls it still runs on
    one device with no mesh. Inside, the names resolve through the strategy's rules (the
    batch's name ``"batch"`` maps to the strategy's batch axes); mesh axes that are manual at
    this point (inside ``shard_map``) are left out.

    Args:
      x: the activation.
      names: one logical name (or None) per dimension of ``x``.

    Returns:
      ``x``, with a ``with_sharding_constraint`` when a strategy is active.

    Example:
      >>> import jax.numpy as jnp, parallax as px
      >>> h = px.constrain(jnp.ones((8, 16, 64)), ("batch", "sequence", "embed"))
    """
    ctx = context.current()
    if ctx is None:
        return x
    names = ctx.strategy.model_hooks.choose_names(names, x.shape, ctx.mesh)
    spec = resolve_spec(
        names,
        x.shape,
        ctx.strategy.activation_rules,
        ctx.mesh,
        api="px.constrain",
        skip_axes=ctx.manual_axes,
        path=f"activation {names}",
    )
    if all(e is None for e in spec):
        # A fully replicated constraint would force a gather; unmapped names mean "free".
        return x
    return jax.lax.with_sharding_constraint(x, spec)
