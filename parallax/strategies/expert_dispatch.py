"""Expert parallelism's mechanism: GShard's two all-to-alls around the local experts.

An MoE layer with a capacity holds, per device, ``[G, E, C, D]`` slots: its G sequences'
tokens sorted into C slots for each of the E experts. With the experts split over an axis
of n devices (E / n each), :meth:`ExpertExchange.exchange`

1. all-to-alls the slots over the axis, splitting E and concatenating G: each device then
   holds ``[n G, E / n, C, D]``, every device's tokens for its own experts;
2. runs its local experts on them;
3. all-to-alls the outputs back (splitting the groups, concatenating the experts), so each
   device has ``[G, E, C, D]`` again, in its tokens' order.

The backward pass is the same two all-to-alls transposed, so one MoE layer costs four per
step, each moving ``G E C D`` elements per device, of which ``(n - 1) / n`` leave it.

In the GSPMD style (no ``shard_map``) :meth:`ExpertExchange.constrained` says the same with
sharding constraints, as GShard did: the slots are pinned split by group over the batch
axes, then split by expert over ``axis`` (and by group over the other batch axes) for the
experts, then back; XLA's partitioner turns each change of layout into an all-to-all.

References:
  Lepikhin et al. 2020, "GShard", sec. 2.2 and 3.2 (the dispatch all-to-all and the combine
  all-to-all); Fedus et al. 2021, "Switch Transformers", fig. 9 (token and expert layout);
  Rajbhandari et al. 2022, "DeepSpeed-MoE" (the same exchange in an explicit runtime).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
from jax import lax
from jax.sharding import Mesh, NamedSharding

DROPLESS_EXCHANGES = ("auto", "ragged", "rounds")
RAGGED_PLATFORMS = ("gpu", "cuda", "rocm", "tpu")  # whose XLA runs ragged_all_to_all


def mesh_platform(mesh) -> str:
    """The platform of the mesh's devices (the default backend's for an abstract mesh)."""
    if isinstance(mesh, Mesh):
        return mesh.devices.flat[0].platform
    return jax.devices()[0].platform


@dataclasses.dataclass(frozen=True)
class ExpertExchange:
    """Tokens to their experts' devices over ``axis`` and back: the ``Strategy.experts`` value.

    Called inside a ``shard_map`` manual over ``axis`` (the explicit step's).

    Attributes:
      axis: the mesh axis the experts are split over.
      dropless: how a dropless layer (``capacity_factor=None``) exchanges its tokens
        (either style): ``"ragged"`` (``jax.lax.ragged_all_to_all``, exact bytes:
        ``parallax.nn.moe_ragged``), ``"rounds"`` (fixed-size all-to-alls in rounds sized
        by the busiest expert: ``parallax.nn.moe_dropless``; runs on every backend) or
        ``"auto"`` (ragged where the mesh's devices are GPUs or TPUs, rounds elsewhere:
        XLA:CPU lacks the ragged op).
      ragged_collective: the ragged all-to-all the ragged exchange calls; None is
        ``jax.lax.ragged_all_to_all``. ``parallax.comm.ragged.emulated_ragged_all_to_all``
        runs the same exchange on CPU (for tests: it all-gathers the operands).

    Example:
      >>> import jax, jax.numpy as jnp, parallax as px
      >>> mesh = px.make_mesh(expert=-1)
      >>> n = mesh.shape["expert"]
      >>> slots = jnp.arange(n * n * 2.0).reshape(n, n, 1, 2)  # [G=1 per device, E=n, C, D]
      >>> f = jax.shard_map(lambda s: ExpertExchange("expert").exchange(s, lambda t: 2 * t),
      ...                   mesh=mesh, in_specs=jax.P("expert"), out_specs=jax.P("expert"))
      >>> bool(jnp.all(f(slots) == 2 * slots))
      True
    """

    axis: str
    dropless: str = "auto"
    ragged_collective: Callable | None = None

    def dropless_exchange(self, mesh: Mesh) -> str:
        """``"ragged"`` or ``"rounds"``: the dropless exchange this mesh runs.

        Example:
          >>> import parallax as px
          >>> ExpertExchange("expert").dropless_exchange(px.make_mesh(expert=-1))
          'rounds'
        """
        return self.resolve(mesh_platform(mesh))

    def resolve(self, platform: str) -> str:
        """``"ragged"`` or ``"rounds"`` on devices of ``platform`` (``"cpu"``, ``"gpu"``, ...)."""
        if self.dropless != "auto":
            return self.dropless
        return "ragged" if platform in RAGGED_PLATFORMS else "rounds"

    def ragged_all_to_all(self) -> Callable:
        """The ragged all-to-all the ragged exchange calls."""
        return self.ragged_collective or lax.ragged_all_to_all

    def exchange(self, slots: jax.Array, run: Callable[[jax.Array], jax.Array]) -> jax.Array:
        """``run`` on every slot by the device of its expert; ``[G, E, C, D]`` in and out.

        Args:
          slots: this device's ``[G, E, C, D]`` slots, E the number of all experts.
          run: the local experts, ``[n G, E / n, C, D] -> [n G, E / n, C, D]``.

        Returns:
          The experts' outputs, ``[G, E, C, D]``, each slot where it came from.
        """
        there = lax.all_to_all(slots, self.axis, split_axis=1, concat_axis=0, tiled=True)
        return lax.all_to_all(run(there), self.axis, split_axis=0, concat_axis=1, tiled=True)

    def constrained(self, slots: jax.Array, run: Callable[[jax.Array], jax.Array], mesh: Mesh,
                    batch_axes: tuple[str, ...]) -> jax.Array:
        """The GSPMD style's exchange: ``run`` on global ``[G, E, C, D]`` slots, laid out by expert.

        Args:
          slots: the global slots, G the whole batch's sequences.
          run: all the experts, ``[G, E, C, D] -> [G, E, C, D]`` (their weights split by E).
          mesh: the step's mesh.
          batch_axes: the strategy's batch axes (``axis`` among them).

        Returns:
          The experts' outputs, laid out by group again.
        """
        other = tuple(a for a in batch_axes if a != self.axis) or None
        free = jax.P.UNCONSTRAINED
        by_group = NamedSharding(mesh, jax.P(batch_axes, None, free, free))
        by_expert = NamedSharding(mesh, jax.P(other, self.axis, free, free))
        there = lax.with_sharding_constraint(
            lax.with_sharding_constraint(slots, by_group), by_expert)
        out = lax.with_sharding_constraint(run(there), by_expert)
        return lax.with_sharding_constraint(out, by_group)

    def __repr__(self) -> str:
        extra = "" if self.dropless == "auto" else f", dropless={self.dropless!r}"
        if self.ragged_collective is not None:
            extra += f", ragged_collective={getattr(self.ragged_collective, '__name__', '?')}"
        return f"ExpertExchange({self.axis!r}{extra})"
