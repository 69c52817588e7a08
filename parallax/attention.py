"""Scaled dot-product attention as the models call it: one entry point a strategy may replace.

The reference models (and any user model that wants it) call :func:`dot_product_attention`
instead of ``jax.nn.dot_product_attention``. Outside a parallax step, and under strategies
that leave the sequence whole, it is exactly ``jax.nn.dot_product_attention``. A strategy
that splits the sequence's attention over devices (context parallelism,
``px.ContextParallel``) supplies its own implementation through the step context
(``Strategy.sequence_split``), so the model's code never names a mesh axis.

Context parallelism holds the sequence in its own order (the zigzag split, which balances
causal attention). A model that runs under it does two more things, both the identity
elsewhere:

- reads its token embeddings with :func:`token_embeddings` (the rows of its ids in that
  order; :func:`in_sequence_order` reorders any other per-token input) and its positions
  from :func:`sequence_positions`, so position embeddings and RoPE see the global index;
- calls :func:`natural_order` on its hidden states before the output projection, so the
  logits are in the order of the labels.

A model that skips them computes causal attention in the wrong order under context
parallelism; ``px.models.GPT`` does both.

Elsewhere the kernel is chosen per backend (:mod:`parallax.attention_kernel`): cuDNN's fused
flash attention on NVIDIA GPUs in bfloat16/float16, Pallas' splash attention on TPUs, XLA
on CPU and as the fallback. One knob overrides it: ``px.train_step(..., attention="xla")``
(or ``dot_product_attention(..., kernel=...)`` for a direct call).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from parallax import attention_kernel, context


def _heads_axis(ctx) -> str | None:
    """The one mesh axis the active strategy splits query heads over (automatic here)."""
    axis = ctx.strategy.activation_rules.get("heads")
    if isinstance(axis, tuple):
        axis = axis[0] if len(axis) == 1 else None
    if axis is None or axis in ctx.manual_axes:
        return None
    return axis


def _split():
    """``(split, mesh)`` of the active step's context parallelism, or None."""
    ctx = context.current()
    if ctx is None or ctx.strategy.sequence_split is None:
        return None
    split = ctx.strategy.sequence_split
    if ctx.mesh.shape.get(split.axis, 1) == 1 or split.axis in ctx.manual_axes:
        return None
    return split, ctx.mesh


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    causal: bool = True,
    scale: float | None = None,
    kernel: str | None = None,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """Softmax attention over ``[batch, seq, heads, head_dim]`` arrays, by the fastest kernel
    that fits the backend (:func:`parallax.attention_kernel.choose_kernel`).

    Under ``px.ContextParallel`` the sequence dimension is split over the context axis in
    the zigzag order, and causal masking compares global positions; the ring's and the
    all-gather's own blockwise kernels run there (``docs/performance.md`` says why not cuDNN's).

    Args:
      query: ``[B, T, H, K]``.
      key, value: ``[B, S, G, K]`` with ``H`` a multiple of ``G`` (grouped-query attention).
      causal: mask each query from the keys after it.
      scale: the logits' scale; None is ``1 / sqrt(K)``.
      kernel: ``"auto"``, ``"xla"``, ``"cudnn"`` or ``"pallas"``; None takes the step's
        ``px.train_step(attention=...)`` (``"auto"`` outside a step).
      segment_ids: int ``[B, T]`` (self-attention, ``S == T``): the document each token
        belongs to in a packed sequence (``parallax.data``); a query attends only to keys
        of its own document (:func:`document_mask`, combined with ``causal``). Not taken
        under ``px.ContextParallel`` (refused with the fix); the mask runs in XLA's kernel
        (the fused ones are not given it yet).

    Returns:
      ``[B, T, H, K]``, as ``jax.nn.dot_product_attention`` returns it.

    Raises:
      ValueError: ``kernel`` names a kernel that cannot run on this backend, dtype or shape.

    Example:
      >>> import jax.numpy as jnp
      >>> from parallax.attention import dot_product_attention
      >>> dot_product_attention(jnp.ones((1, 4, 2, 8)), jnp.ones((1, 4, 1, 8)),
      ...                       jnp.ones((1, 4, 1, 8))).shape
      (1, 4, 2, 8)

    References:
      Vaswani et al. 2017, "Attention Is All You Need"; Ainslie et al. 2023 (GQA).
    """
    found = _split()
    if found is not None:
        split, mesh = found
        if segment_ids is not None:
            raise ValueError(
                "parallax.attention.dot_product_attention: segment_ids (packed documents) "
                f"are not taken under context parallelism ({context.current().strategy.name}"
                f", axis {split.axis!r} of size {mesh.shape[split.axis]}): its ring and "
                "all-gather attention mask only causally. Train packed batches without "
                "px.ContextParallel, or pass batches without 'segment_ids' (one document "
                "per row).")
        return split.attention(query, key, value, causal=causal, scale=scale, mesh=mesh,
                               heads_axis=_heads_axis(context.current()))
    api = "parallax.attention.dot_product_attention"
    if kernel is None:
        ctx = context.current()
        kernel, api = ("auto", api) if ctx is None else (ctx.attention, "px.train_step")
    mask = None if segment_ids is None else document_mask(segment_ids, query.shape[:2],
                                                          key.shape[1])
    choice = attention_kernel.choose_for(query, key, kernel, api, masked=mask is not None)
    return attention_kernel.run(choice.kernel, query, key, value, causal=causal, scale=scale,
                                mask=mask)


def document_mask(segment_ids: jax.Array, query_shape: tuple[int, int] | None = None,
                  key_length: int | None = None) -> jax.Array:
    """Which keys each query may see in a packed sequence: those of its own document.

    Args:
      segment_ids: int ``[B, T]``, the document of each token (``0``: padding, which sees
        only padding, so no row of the softmax is empty).
      query_shape: ``(B, T)`` of the queries, checked against ``segment_ids`` (optional).
      key_length: S of the keys, which must be T (self-attention; optional).

    Returns:
      bool ``[B, 1, T, T]`` (broadcast over heads), ``jax.nn.dot_product_attention``'s
      ``mask``; the causal mask is applied on top by ``is_causal``.

    Example:
      >>> document_mask(jnp.array([[1, 1, 2]]))[0, 0].astype(int).tolist()
      [[1, 1, 0], [1, 1, 0], [0, 0, 1]]
    """
    api = "parallax.attention.dot_product_attention"
    shape = tuple(getattr(segment_ids, "shape", ()))
    if (len(shape) != 2 or not jnp.issubdtype(segment_ids.dtype, jnp.integer)
            or (query_shape is not None and shape != tuple(query_shape))
            or (key_length is not None and key_length != shape[-1])):
        want = "[batch, seq]" if query_shape is None else list(query_shape)
        raise ValueError(
            f"{api}: segment_ids must be integer ids {want} (one per query token, "
            f"self-attention), got shape {list(shape)} dtype "
            f"{getattr(segment_ids, 'dtype', type(segment_ids).__name__)}"
            + ("" if key_length is None else f" with {key_length} keys") + "; pass the "
            "packed batch's 'segment_ids' without the last column, as the tokens.")
    return (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])


def sequence_positions(length: int, api: str = "parallax.attention.sequence_positions"
                       ) -> jax.Array:
    """The global position of each slot of a length-``length`` sequence, as the model holds it.

    ``arange(length)`` outside context parallelism; under it, the zigzag order.

    Args:
      length: T.
      api: the caller, named in the error.

    Returns:
      An int32 ``[T]`` permutation of ``range(T)``.

    Raises:
      ValueError: under context parallelism over ``n`` devices, ``T`` not a multiple of
        ``2n``.

    Example:
      >>> sequence_positions(4).tolist()
      [0, 1, 2, 3]
    """
    found = _split()
    order = None if found is None else found[0].order(length, found[1], api)
    return jnp.arange(length, dtype=jnp.int32) if order is None else jnp.asarray(order)


def in_sequence_order(x: jax.Array, api: str = "parallax.attention.in_sequence_order"
                      ) -> jax.Array:
    """``x`` (sequence on axis 1, natural order, every position present) in the model's
    order: a gather of the slots :func:`sequence_positions` names; the identity outside
    context parallelism. Meant for token ids, which every device of the context axis holds.

    Example:
      >>> in_sequence_order(jnp.arange(6).reshape(2, 3)).tolist()
      [[0, 1, 2], [3, 4, 5]]
    """
    found = _split()
    order = None if found is None else found[0].order(x.shape[1], found[1], api)
    return x if order is None else jnp.take(x, jnp.asarray(order), axis=1)


def token_embeddings(table: jax.Array, tokens: jax.Array,
                     api: str = "parallax.attention.token_embeddings") -> jax.Array:
    """The rows of an embedding ``table`` ``[V, D]`` for token ids ``tokens`` ``[B, T]`` (natural
    order), in the model's order: ``jnp.take(table, in_sequence_order(tokens), axis=0)``.

    Under context parallelism composed with an axis that may split the table (tensor
    parallelism's vocabulary) inside a manual region (the explicit step's ``shard_map`` over
    the batch axes), the lookup is not left to GSPMD: XLA 0.12's partitioner aborts the
    process on it (``spmd_partitioner_util.cc``: ``Check failed: partition_group_list...``
    in ``ExpandDeviceGroupsWithIota``): on the lookup from ``T = 128`` (the abort seen with
    0.12.0.1) and on its gradient's scatter-add at every length (0.12.1);
    ``tests/strategies/test_context_lookup.py`` reproduces both without parallax. parallax
    looks each device's ids up in a ``shard_map`` over the context axis and gathers the ids and the rows' gradient over it
    before the scatter-add: the collectives XLA 0.10 chose by itself for ``jnp.take``.
    Elsewhere this is ``jnp.take(table, in_sequence_order(tokens), axis=0)``, which a model
    may call itself (the two are the same outside that composition).

    Args:
      table: ``[V, D]`` embedding rows.
      tokens: integer ids ``[B, T]``, natural order.
      api: the caller, named in errors.

    Returns:
      ``[B, T, D]``, in the model's sequence order.

    Example:
      >>> table = jnp.arange(6.0).reshape(3, 2)
      >>> token_embeddings(table, jnp.array([[2, 0]])).tolist()
      [[[4.0, 5.0], [0.0, 1.0]]]
    """
    ids = in_sequence_order(tokens, api)
    found = _split()
    if found is None:
        return jnp.take(table, ids, axis=0)
    return found[0].lookup(table, ids, context.current())


def pipeline_stage_axis() -> str | None:
    """The pipeline's stage axis while a stage's actions are traced (the axis manual in the
    pipeline runtime's ``shard_map``), else None.

    Example:
      >>> pipeline_stage_axis() is None   # outside a parallax step
      True
    """
    ctx = context.current()
    producer = getattr(getattr(ctx, "strategy", None), "grad_fn", None)
    axis = getattr(getattr(producer, "settings", None), "axis", None)
    return axis if ctx is not None and axis in ctx.manual_axes else None


def whole_labels(labels: jax.Array) -> jax.Array:
    """Token ids (sequence on axis 1) held whole on every device of the context axis inside
    a pipeline stage under context parallelism; the identity elsewhere.

    A loss that shifts its labels (``tokens[:, 1:]``) next to logits split by sequence gets,
    from GSPMD, a halo ``collective-permute`` of a few ids over the context axis. Inside a
    pipeline stage that permute spans every stage while one stage runs its action alone, so
    it would wait forever (:mod:`parallax.strategies.context_parallel.stage_groups`); whole
    ids slice locally.

    Example:
      >>> whole_labels(jnp.arange(6).reshape(2, 3)).tolist()
      [[0, 1, 2], [3, 4, 5]]
    """
    if _split() is None or pipeline_stage_axis() is None:
        return labels
    free = jax.P.UNCONSTRAINED
    return jax.lax.with_sharding_constraint(labels, jax.P(free, *[None] * (labels.ndim - 1)))


def natural_order(x: jax.Array, api: str = "parallax.attention.natural_order") -> jax.Array:
    """``x`` (sequence on axis 1, in the model's order) back in natural order.

    The identity outside context parallelism; under it, one exchange between the devices of
    the context axis (two ``ppermute`` s of half of each device's part).

    Example:
      >>> natural_order(jnp.ones((2, 4, 8))).shape
      (2, 4, 8)
    """
    found = _split()
    return x if found is None else found[0].natural(x, found[1], api)
