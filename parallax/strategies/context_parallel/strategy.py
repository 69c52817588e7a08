"""Context parallelism: a sequence's attention split over a mesh axis.

``px.ContextParallel(axis, method)`` maps the activations' logical ``"sequence"`` dimension
to ``axis``, so every layer but attention runs on ``T / n`` positions per device with no
communication (GSPMD: parameters are replicated over the axis and their gradients summed
over it). It maps ``"length"`` there too: the name the models give the sequence of the
attention heads and the MLP's hidden, which tensor parallelism keeps whole and context
parallelism keeps split (so Megatron's layout gathers nothing over ``axis``). Attention needs every key: the models call :func:`parallax.attention.
dot_product_attention`, which under this strategy opens a ``shard_map`` over ``axis`` and
runs one of

- ``"ring"``: K/V blocks passed round the axis with ``ppermute`` while each device
  accumulates its queries' output with the online softmax
  (:mod:`parallax.strategies.context_parallel.ring`; Liu et al. 2023);
- ``"all_gather"``: K and V all-gathered over the axis at each layer and the local queries
  attend to all of them, one key block at a time (Llama 3's choice, Dubey et al. 2024,
  section 3.3.2; :mod:`parallax.strategies.context_parallel.gather`); the backward
  reduce-scatters their gradients.

The sequence is held in the zigzag order (:mod:`parallax.strategies.context_parallel.zigzag`) so
causal attention costs every device the same; a model reads its positions from
:func:`parallax.attention.sequence_positions` and returns to natural order with
:func:`parallax.attention.natural_order` before its output projection (the GPT does).

Under ``px.Pipeline`` (data x stage x context) each stage runs its layers' attention over
the context devices of its own stage: the pipeline's ``shard_map`` is manual over the
stage axis, attention's is nested in it over ``axis``, and since the stages run different
actions at a tick, the ring's and the zigzag's point-to-point messages go as all-to-alls
over ``axis`` (one replica group per stage) instead of ``ppermute`` s
(:mod:`parallax.strategies.context_parallel.stage_groups` says why and what it costs).
Tested with GPipe, 1F1B and ZB-H1 and both methods
(``tests/strategies/test_context_pipeline.py``; interleaved 1F1B and ZB-V were checked once,
outside the suite: ``docs/context_parallel.md``). Under a pipeline the parameters' gradients
are summed over ``axis`` by each backward (once per micro-batch), not once per step.

Under ``data x context x tensor`` the models' token lookup is split here too
(:meth:`ContextSplit.lookup`, called by :func:`parallax.attention.token_embeddings`): XLA
0.12's partitioner aborts the process on the lookup GSPMD would write there.

Not supported: Megatron's sequence parallelism, which splits the same sequence dimension
over the tensor axis (``compose`` refuses it: CP already splits the sequence).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from parallax.comm import nesting
from parallax.mesh import describe
from parallax.rules import resolve_spec
from parallax.strategies.context_parallel import gather
from parallax.strategies.context_parallel import ring as context_ring
from parallax.strategies.context_parallel import stage_groups as context_groups
from parallax.strategies.context_parallel import zigzag as context_zigzag
from parallax.strategy import Strategy

METHODS = ("ring", "all_gather")
API = "px.ContextParallel"


@dataclasses.dataclass(frozen=True)
class ContextSplit:
    """The :class:`parallax.strategy.SequenceSplit` of context parallelism.

    Attributes:
      axis: the context mesh axis.
      method: ``"ring"`` or ``"all_gather"``.
    """

    axis: str
    method: str

    def ways(self, mesh: Mesh) -> int:
        return int(mesh.shape.get(self.axis, 1))

    def order(self, length: int, mesh: Mesh, api: str):
        n = self.ways(mesh)
        if n == 1:
            return None
        if length % (2 * n):
            fit = length + 2 * n - length % (2 * n)
            raise ValueError(
                f"{api}: sequence length {length} does not split into the 2 x {n} = {2 * n} "
                f"equal chunks of {API}({self.axis!r}) (zigzag: each of the {n} devices of "
                f"mesh axis {self.axis!r} holds chunks i and {2 * n - 1}-i; mesh "
                f"{describe(mesh)}); use a length that is a multiple of {2 * n}, e.g. {fit} "
                "(next_token_loss takes tokens [batch, length + 1]).")
        return context_zigzag.positions(length, n)

    def _map(self, fn, in_specs, out_specs, heads_axis=None):
        # jax.checkpoint: the partial evaluation that lax.scan runs over a scanned layer
        # (to hoist loop invariants) would otherwise split this shard_map, and the residuals
        # of a shard_map nested in the step's (manual over the batch axes) get a sharding
        # jax 0.10 cannot lower ("manual axes must come before free axes"). Under remat
        # nothing inside is kept as a residual; the forward still runs once.
        manual = frozenset({self.axis} | ({heads_axis} if heads_axis else set()))
        nesting.check(manual, API, "Build the mesh with px.make_mesh (it names the context "
                      "axis after the batch and pipeline axes).")
        return jax.checkpoint(jax.shard_map(fn, in_specs=in_specs, out_specs=out_specs,
                                            axis_names=manual))

    def attention(self, query, key, value, *, causal: bool, scale, mesh: Mesh,
                  heads_axis: str | None = None):
        """``heads_axis``: the mesh axis the step splits the query heads over (tensor
        parallelism), or None."""
        n = self.ways(mesh)
        length = query.shape[1]
        self.order(length, mesh, "parallax.attention.dot_product_attention")
        scale = float(scale) if scale is not None else 1.0 / float(np.sqrt(query.shape[-1]))
        seq = PartitionSpec(None, self.axis)
        rows = PartitionSpec(None, None, None, self.axis)  # lse [B, G, H/G, T]
        if self.method == "ring":
            method = context_ring
            kw = dict(axis=self.axis, n=n, causal=causal, scale=scale,
                      groups=context_groups.current())
            heads_axis = None
        else:
            method = gather
            kw = dict(axis=self.axis, positions=context_zigzag.positions(length, n),
                      causal=causal, scale=scale)
            # Under tensor parallelism the map is manual over the heads' axis too, each
            # device holding its H/t query heads and the G/t key/value heads they read (a
            # local slice where K/V are replicated over that axis): left automatic, XLA
            # gathers the heads over it before the all-gather over the context axis (t
            # times the bytes).
            heads_axis = heads_axis if _splits_heads(heads_axis, mesh, query, key) else None
            if heads_axis is not None:
                seq = PartitionSpec(None, self.axis, heads_axis)
                rows = PartitionSpec(None, heads_axis, None, self.axis)
        fwd = self._map(functools.partial(method.forward, **kw), (seq,) * 3, (seq, rows),
                        heads_axis)
        bwd = self._map(functools.partial(method.backward, **kw), (seq,) * 4 + (rows, seq),
                        (seq,) * 3, heads_axis)
        residuals = lambda q, k, v: (lambda o, lse: (o, (q, k, v, o, lse)))(*fwd(q, k, v))
        return _with_vjp(residuals, lambda res, d_out: bwd(*res, d_out))(query, key, value)

    def natural(self, x, mesh: Mesh, api: str):
        n = self.ways(mesh)
        if n == 1:
            return x
        self.order(x.shape[1], mesh, api)
        seq = PartitionSpec(None, self.axis)
        groups = context_groups.current()
        forward = self._map(lambda v: context_zigzag.to_natural(v, self.axis, n, groups),
                            seq, seq)
        backward = self._map(lambda g: context_zigzag.to_zigzag(g, self.axis, n, groups),
                             seq, seq)
        # A custom_vjp for the reason _with_vjp gives (its transpose is the inverse exchange).
        natural = jax.custom_vjp(lambda v: forward(v))
        natural.defvjp(lambda v: (forward(v), None), lambda _, g: (backward(g),))
        return natural(x)

    def lookup(self, table, ids, ctx):
        """``jnp.take(table, ids, axis=0)``, ``ids`` ``[B, T]`` in the zigzag order.

        Where the table may be split over another automatic axis (tensor parallelism's
        vocabulary) inside a manual region (the explicit step's ``shard_map`` over the batch
        axes), GSPMD is not left to choose how to split the lookup, which XLA 0.12 aborts
        on (``parallax.attention.token_embeddings`` says when): the forward runs in a
        ``shard_map`` over the context axis (each device looks up its own ids; the table
        stays automatic), and the backward gathers the ids and the rows' cotangent over the
        context axis before the scatter-add into the table. Both are what XLA 0.10 chose by
        itself for ``jnp.take``: the same collectives, the same bytes.
        """
        manual = ctx.manual_axes
        others = [a for a in ctx.strategy.mesh_axes() if a != self.axis and a not in manual
                  and int(ctx.mesh.shape.get(a, 1)) > 1]
        if not manual or not others:
            return jnp.take(table, ids, axis=0)
        take = lambda t, i: jnp.take(t, i, axis=0)
        seq = PartitionSpec(None, self.axis)
        forward = self._map(take, (PartitionSpec(), seq), seq)
        whole = lambda shape: resolve_spec(
            ("batch",) + (None,) * (len(shape) - 1), shape, ctx.strategy.activation_rules,
            ctx.mesh, api="parallax.attention.token_embeddings", skip_axes=manual,
            path="the token embeddings' gradient")
        ids_whole, rows_whole = whole(ids.shape), whole(ids.shape + table.shape[1:])

        def backward(residuals, d_rows):
            t, i = residuals
            i = lax.with_sharding_constraint(i, ids_whole)
            d_rows = lax.with_sharding_constraint(d_rows, rows_whole)
            return jax.vjp(lambda t: take(t, i), t)[1](d_rows)[0], None

        lookup = jax.custom_vjp(lambda t, i: forward(t, i))
        lookup.defvjp(lambda t, i: (forward(t, i), (t, i)), backward)
        return lookup(table, ids)

    def check(self, strategies) -> None:
        for s in strategies:
            if s.sequence_split is self:
                continue
            seq = dict(s.rules).get("sequence")
            if seq is not None:
                raise ValueError(
                    f"px.compose: {s.name} splits the sequence over {seq!r} and "
                    f"ContextParallel({self.axis!r}) splits it over {self.axis!r}; the two "
                    "cannot both split it. Turn sequence parallelism off "
                    "(px.TensorParallel(..., sequence_parallel=False)): context parallelism "
                    "already keeps every activation split by sequence.")


def _splits_heads(heads_axis, mesh: Mesh, query, key) -> bool:
    """Whether the attention's map can be manual over ``heads_axis``: both the query heads
    H and the key/value heads G divide over it (else the heads stay automatic)."""
    t = int(mesh.shape.get(heads_axis, 1)) if heads_axis else 1
    return t > 1 and query.shape[2] % t == 0 and key.shape[2] % t == 0


def _with_vjp(forward, backward):
    """``f(q, k, v)`` whose forward is ``forward -> (out, residuals)`` and backward
    ``backward(residuals, d_out) -> (dq, dk, dv)``, each its own ``shard_map``: autodiff
    through one nested in the step's leaves residuals jax 0.10 cannot lower (manual axes
    out of order on the residuals' leading dimension)."""

    @jax.custom_vjp
    def f(q, k, v):
        return forward(q, k, v)[0]

    f.defvjp(forward, backward)
    return f


def ContextParallel(axis: str = "context", method: str = "ring") -> Strategy:
    """Splits every sequence over ``axis``; attention by a ring or an all-gather of K/V.

    Args:
      axis: the mesh axis (``px.make_mesh(context=n)``).
      method: ``"ring"`` (K/V passed round the axis, online softmax: memory ``O(T/n)``) or
        ``"all_gather"`` (K/V gathered per layer: ``O(T)`` keys per device, one collective).

    Returns:
      A :class:`parallax.Strategy` mapping ``"sequence"`` and ``"length"`` to ``axis``.

    Raises:
      TypeError: ``axis`` is not a string.
      ValueError: an unknown ``method``.

    Example:
      >>> import parallax as px
      >>> s = px.compose(px.DataParallel(), px.ContextParallel(method="all_gather"))
      >>> s.rule_table["sequence"], s.sequence_split.method
      ('context', 'all_gather')

    References:
      Liu et al., "Ring Attention with Blockwise Transformers", 2023; Dubey et al., "The
      Llama 3 Herd of Models", 2024, section 3.3.2 (all-gather CP, the 2 x CP chunks).
    """
    if not isinstance(axis, str):
        raise TypeError(f"{API}: axis must be a mesh axis name (a str), got "
                        f"{type(axis).__name__}: {axis!r}.")
    if method not in METHODS:
        raise ValueError(f"{API}: method={method!r} must be one of {METHODS}.")
    return Strategy(
        name=f"ContextParallel({axis!r}, method={method!r})",
        rules=(("sequence", axis), ("length", axis)),
        sequence_split=ContextSplit(axis, method),
    )
