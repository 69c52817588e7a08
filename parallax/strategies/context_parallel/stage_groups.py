"""Context parallelism's point-to-point messages inside a pipeline stage.

Under ``px.Pipeline`` the attention runs inside the runtime's guarded actions: at a given
tick one stage runs a forward while another is idle or runs a backward. Every device of a
stage takes the same branch, so a collective whose participants are one stage's devices
is sound there: an all-gather, reduce-scatter or all-to-all over ``context`` has one
replica group per stage (the all-gather method's collectives and GSPMD's are of this
kind). A ``ppermute`` over ``context`` is not: XLA's ``collective-permute`` has no replica
groups, and the CPU runtime makes every device of the program meet at it whatever its
source-target pairs (measured, jax 0.10.2: a stage=2 x context=2 ring stopped at the first
shift, "Expected 4 threads to join the rendezvous, but only 2 of them arrived"; the same
with the pairs of one stage only, behind a ``lax.switch`` on the stage index).

Inside a stage, :class:`StageGroups` therefore sends a permutation as one ``all_to_all``
over the context axis: each device puts its message in its destination's slot of an
``[n, ...]`` buffer (zeros elsewhere) and reads the slot of its source. For ``n = 2`` the
bytes that cross the wire are the ``ppermute``'s (the other slot stays on the device); for
``n > 2`` they are ``n - 1`` times them (zeros travel too), so under a pipeline the ring
method costs more than the all-gather method beyond two context devices.

References:
  torchtitan (context parallelism composed with pipeline parallelism, one CP group per
  stage); Huang et al. 2019, GPipe.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from parallax import context
from parallax.attention import pipeline_stage_axis
from parallax.comm.compress import ppermute_wire


@dataclasses.dataclass(frozen=True)
class StageGroups:
    """The pipeline's stage axis, when context messages must stay inside one stage.

    Attributes:
      axis: the pipeline's mesh axis (manual where the stage bodies run).
      size: its number of stages.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> mesh = jax.make_mesh((2, 2), ("stage", "context"),
      ...                      axis_types=(jax.sharding.AxisType.Auto,) * 2)
      >>> groups = StageGroups("stage", 2)
      >>> f = jax.shard_map(lambda v: groups.permute(v, "context", 2, [(0, 1), (1, 0)]),
      ...                   mesh=mesh, in_specs=jax.P(("stage", "context")),
      ...                   out_specs=jax.P(("stage", "context")))
      >>> f(jnp.arange(4.0)).tolist()
      [1.0, 0.0, 3.0, 2.0]
    """

    axis: str
    size: int

    def permute(self, x: jax.Array, axis: str, n: int, perm) -> jax.Array:
        """``lax.ppermute(x, axis, perm)`` as one ``all_to_all`` over ``axis`` (size ``n``):
        a device that is no destination receives zeros, as from ``ppermute``.

        Call where ``axis`` is manual.
        """
        dst, src = np.full(n, -1, np.int32), np.full(n, -1, np.int32)
        for a, b in perm:
            dst[a], src[b] = b, a
        i = lax.axis_index(axis)
        slot = jnp.arange(n).reshape(n, *[1] * x.ndim)
        out = jnp.where(slot == jnp.asarray(dst)[i], x[None], jnp.zeros_like(x)[None])
        got = lax.all_to_all(out, axis, split_axis=0, concat_axis=0, tiled=True)
        source = jnp.asarray(src)[i]
        picked = lax.dynamic_index_in_dim(got, jnp.maximum(source, 0), keepdims=False)
        return jnp.where(source >= 0, picked, jnp.zeros_like(picked))


def permute(x: jax.Array, axis: str, n: int, perm, groups: StageGroups | None) -> jax.Array:
    """``ppermute`` of ``x`` over ``axis``; within each stage when ``groups`` is given."""
    if groups is None:
        return ppermute_wire(x, axis, list(perm))
    return groups.permute(x, axis, n, perm)


def current() -> StageGroups | None:
    """The :class:`StageGroups` of the step being traced: the pipeline's axis when its
    stages are manual here (inside the runtime) and more than one, else None."""
    axis = pipeline_stage_axis()
    if axis is None:
        return None
    size = int(context.current().mesh.shape.get(axis, 1))
    return StageGroups(axis, size) if size > 1 else None
