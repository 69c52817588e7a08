"""``jax.lax.ragged_all_to_all``'s semantics in plain collectives, for backends that lack it.

XLA's CPU backend does not implement the ragged all-to-all (``UNIMPLEMENTED: HLO opcode
ragged-all-to-all is not supported by XLA:CPU``). :func:`emulated_ragged_all_to_all` takes
the same arguments and gives the same result from an ``all_gather`` of every device's operand
and offsets: each device then writes, into its own ``output``, the slices that were sent to
it. It moves ``n`` times the operand over the axis instead of the slices alone, so it is for
checking, on CPU, a program written for the real op (the dropless MoE's ragged exchange is
tested equal to one device through it), not for speed.

The semantics, as jax's docstring of ``ragged_all_to_all`` states them (jax 0.10.2 and
0.12.1 alike): the four index arrays have one length ``K``, a multiple of the axis size
``n``; slice ``i`` of the caller (``operand[input_offsets[i]:][:send_sizes[i]]``) goes to
device ``i // (K / n)``, which writes it at ``output_offsets[i]`` (an offset on the
*receiver*); on the receiver, ``recv_sizes[i]`` is the size of the slice coming from device
``i // (K / n)``, and the rest of ``output`` keeps its values.

References:
  ``jax.lax.ragged_all_to_all`` (its docstring is the specification followed here);
  XLA's ``RaggedAllToAll`` operation semantics.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def emulated_ragged_all_to_all(operand: jax.Array, output: jax.Array,
                               input_offsets: jax.Array, send_sizes: jax.Array,
                               output_offsets: jax.Array, recv_sizes: jax.Array, *,
                               axis_name: str, axis_index_groups=None) -> jax.Array:
    """``jax.lax.ragged_all_to_all``'s result, from an all-gather and a masked scatter.

    Called inside a ``shard_map`` manual over ``axis_name``, like the real op; same
    arguments (``axis_index_groups`` is not supported). ``recv_sizes`` is not needed: the
    senders' ``send_sizes`` say the same (the op requires them to agree), so it is only
    checked for its shape.

    Example:
      >>> import jax, jax.numpy as jnp, parallax as px
      >>> mesh = px.make_mesh(expert=2, devices=jax.devices()[:2])
      >>> # jax's docstring example: device 0 sends [1] to 0 and [2, 2] to 1, device 1
      >>> # sends [3] to 0 and [4] to 1.
      >>> args = [jnp.array(a, jnp.int32) for a in (
      ...     [1, 2, 2, 3, 4, 0], [0] * 8, [0, 1, 0, 1], [1, 2, 1, 1], [0, 0, 1, 2],
      ...     [1, 1, 2, 1])]
      >>> f = jax.shard_map(lambda *a: emulated_ragged_all_to_all(*a, axis_name="expert"),
      ...                   mesh=mesh, in_specs=jax.P("expert"), out_specs=jax.P("expert"))
      >>> f(*args).tolist()
      [1, 3, 0, 0, 2, 2, 4, 0]
    """
    if axis_index_groups is not None:
        raise NotImplementedError("emulated_ragged_all_to_all: axis_index_groups is not "
                                  "supported; split the mesh axis instead.")
    k = input_offsets.shape[0]
    if not (send_sizes.shape == output_offsets.shape == recv_sizes.shape == (k,)):
        raise ValueError(
            f"emulated_ragged_all_to_all: input_offsets, send_sizes, output_offsets and "
            f"recv_sizes must be 1D of one length, got {input_offsets.shape}, "
            f"{send_sizes.shape}, {output_offsets.shape}, {recv_sizes.shape}.")
    n = lax.axis_size(axis_name)
    if k % n:
        raise ValueError(f"emulated_ragged_all_to_all: the index arrays' length {k} must be "
                         f"a multiple of the size {n} of axis {axis_name!r}.")
    per = k // n  # slices each device sends to each device
    me = lax.axis_index(axis_name)
    rows = operand.shape[0]
    # Every device's operand and the offsets and sizes of the slices it sends to me.
    operands = lax.all_gather(operand, axis_name)  # [n, rows, ...]
    mine = lambda a: lax.dynamic_slice_in_dim(  # noqa: E731 - [n, per]: the slices to me
        lax.all_gather(a, axis_name), me * per, per, axis=1)
    start, size, where = mine(input_offsets), mine(send_sizes), mine(output_offsets)
    r = jnp.arange(rows)[None, None, :]  # [1, 1, rows]
    sent = (r >= start[..., None]) & (r < (start + size)[..., None])  # [n, per, rows]
    target = jnp.where(sent, where[..., None] + r - start[..., None], output.shape[0])
    updates = jnp.broadcast_to(operands[:, None], (n, per) + operands.shape[1:])
    flat = target.reshape(-1)
    return output.at[flat].set(updates.reshape((-1,) + operand.shape[1:]), mode="drop")
