"""Dropless MoE under expert parallelism with ragged all-to-alls: exact bytes, no padding.

Where the backend has ``jax.lax.ragged_all_to_all`` (GPU, TPU), each device sends each
expert exactly its routed tokens, not rounds of ``c`` slots per expert
(``parallax.nn.moe_dropless``). On one device of the ``n`` along the expert axis, with
``E / n = L`` local experts and ``N`` tokens choosing ``k`` experts each:

1. the ``N k`` choices are sorted by expert (so by destination device, then local expert),
   and the ``[E]`` counts are all-gathered over the axis (``[n, E]``, one int32 each);
2. dispatch: one ragged all-to-all with ``E`` slices, slice ``e`` (this device's tokens for
   expert ``e``) going to the device of expert ``e``, which lays its receipts out by local
   expert, then by sender: the ``L`` groups of ``jax.lax.ragged_dot``;
3. the local experts run as three ``ragged_dot``s on the received rows;
4. combine: the ragged all-to-all back (the same slices, the other way), then the outputs
   are unsorted and summed with the gates.

The backward pass is the same two ragged all-to-alls transposed (jax's transpose rule,
which also all-to-alls the ``[E]`` offsets). Per MoE layer, device and step the bytes are
``2 N k D + 2 R D`` elements (``R`` the rows this device's experts received; the mean of
``R`` over devices is ``N k``): the routed tokens.

The receive buffer must have a static size. Dropless cannot bound it below the worst case,
so it is ``n N min(k, L)`` rows: every device's every token choosing this device's experts
(a token picks k distinct experts, at most ``min(k, L)`` of them here). That is
``min(k, L) / L`` of the padded path's ``[n G, L, S, D]`` slots (the same when ``L <= k``),
and the ``ragged_dot``'s ``[rows, F]`` activations are sized by it too: the memory is the
worst case's, the bytes and the useful FLOPs the routed tokens'.

The collective is an argument: :func:`parallax.comm.ragged.emulated_ragged_all_to_all` runs
the same program on CPU, whose XLA lacks the op.

References:
  Gale et al. 2022, "MegaBlocks" (dropless, grouped matmuls);
  ``jax.lax.ragged_all_to_all`` and ``jax.lax.ragged_dot`` (the two primitives);
  MaxText ``layers/moe.py`` (ragged all-to-all expert parallelism, the same two exchanges).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from parallax.comm.varying import to_varying, varying_axes

GroupedRun = Callable[[jax.Array, jax.Array], jax.Array]


def receive_rows(tokens: int, top_k: int, num_experts: int, devices: int) -> int:
    """The receive buffer's rows: ``n N min(k, E / n)``, every choice that can reach a device.

    Example:
      >>> receive_rows(tokens=32, top_k=2, num_experts=64, devices=8)
      512
    """
    return devices * tokens * min(top_k, num_experts // devices)


def exclusive_cumsum(x: jax.Array, axis: int = -1) -> jax.Array:
    """The sum of the entries before each one along ``axis``: offsets from sizes.

    Example:
      >>> exclusive_cumsum(jnp.array([2, 0, 3])).tolist()
      [0, 2, 2]
    """
    return jnp.cumsum(x, axis=axis) - x


def ragged_plan(counts: jax.Array, me: jax.Array, local: int) -> dict[str, jax.Array]:
    """The offsets and sizes of both exchanges, from every device's ``[n, E]`` counts.

    Device ``j`` lays out what it receives by local expert ``l``, then by sender ``s``:
    the rows of ``(l, s)`` start at ``sum_{l' < l} total[j L + l'] + sum_{s' < s}
    counts[s', j L + l]``. Every device computes every offset from the gathered counts.

    Example:
      >>> counts = jnp.array([[1, 2], [3, 0]])  # 2 devices, one expert each
      >>> plan = ragged_plan(counts, me=jnp.array(1), local=1)
      >>> plan["send_where"].tolist(), plan["recv_size"].tolist(), plan["groups"].tolist()
      ([1, 2], [2, 0], [2])
    """
    n, e = counts.shape
    total = counts.sum(0)  # [E] rows each expert receives
    expert_base = exclusive_cumsum(total.reshape(n, local)).reshape(e)  # group starts
    before = exclusive_cumsum(counts, axis=0)  # [n, E]: rows of senders s' < s
    at_receiver = expert_base[None] + before  # [n, E]: where (s, e) lands on e's device
    sorted_start = exclusive_cumsum(counts)  # [n, E]: where (s, e) starts in s's sorted rows
    take = lambda a: lax.dynamic_slice_in_dim(a, me * local, local, axis=1)  # noqa: E731
    return {
        # Dispatch: my E slices, slice e to the device of expert e.
        "send_start": sorted_start[me], "send_size": counts[me],
        "send_where": at_receiver[me],
        "recv_size": take(counts).reshape(-1),  # [n L]: (sender s, local expert l)
        # Combine: my received groups back to their senders, (s, l) ordered.
        "back_start": take(at_receiver).reshape(-1), "back_where": take(sorted_start).reshape(-1),
        "groups": lax.dynamic_slice_in_dim(total, me * local, local),  # [L] ragged_dot sizes
    }


def dropless_ragged(x: jax.Array, experts: jax.Array, gates: jax.Array, run: GroupedRun,
                    axis: str, num_experts: int,
                    collective: Callable = lax.ragged_all_to_all) -> jax.Array:
    """The gated sum of each token's k experts' outputs, every choice kept; ``[G, S, D]``.

    Called inside a ``shard_map`` manual over ``axis`` (the explicit step's).

    Args:
      x: this device's tokens, ``[G, S, D]``.
      experts: ``[G, S, k]`` chosen experts (global ids).
      gates: ``[G, S, k]`` their weights.
      run: the local experts on rows grouped by local expert: ``(rows [M, D], sizes [L])
        -> [M, D]`` (``ragged_dot`` with the local weights).
      axis: the mesh axis the experts are split over.
      num_experts: E.
      collective: ``jax.lax.ragged_all_to_all`` or a function with its signature.

    Returns:
      ``y [G, S, D] = sum_j gates[..., j] * expert_{experts[..., j]}(x)``, as one device
      computes it.
    """
    g, s, d = x.shape
    tokens, k = g * s, experts.shape[-1]
    n = lax.axis_size(axis)
    local = num_experts // n
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sent = x.reshape(tokens, d)[order // k]  # [N k, D] sorted by expert
    counts = lax.all_gather(jnp.bincount(flat, length=num_experts).astype(jnp.int32), axis)
    plan = ragged_plan(counts, lax.axis_index(axis), local)
    spanned = tuple(sorted(varying_axes(sent) | {axis}))
    buffer = to_varying(jnp.zeros((receive_rows(tokens, k, num_experts, n), d), x.dtype),
                        spanned)
    with jax.named_scope("dropless_ragged_dispatch"):
        got = collective(sent, buffer, plan["send_start"], plan["send_size"],
                         plan["send_where"], plan["recv_size"], axis_name=axis)
    done = run(got, plan["groups"])
    with jax.named_scope("dropless_ragged_combine"):
        back = collective(done, to_varying(jnp.zeros_like(sent), spanned), plan["back_start"],
                          plan["recv_size"], plan["back_where"], plan["send_size"],
                          axis_name=axis)
    out = jnp.zeros_like(back).at[order].set(back)
    gates = gates.reshape(tokens, k, 1).astype(x.dtype)
    return jnp.sum(out.reshape(tokens, k, d) * gates, axis=1).reshape(g, s, d)
