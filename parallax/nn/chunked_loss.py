"""Cross-entropy from hidden states, a chunk of the sequence at a time: no ``[B, T, V]`` logits.

A language model's loss is ``cross_entropy(x W^T, labels)`` for hidden states ``x`` ``[B, T, D]``
and an output matrix ``W`` ``[V, D]``. Computed at once, the float32 logits ``[B, T, V]``
(3.3 GB for GPT-2 at 16 x 1024 tokens) and their gradient are the largest buffers of a step.
Here the positions are split into ``n`` chunks; a ``lax.map`` over the chunks computes each
chunk's logits, their log-sum-exp and target logit, and keeps only the ``[B, T / n]`` losses
and log-sum-exps. A ``custom_vjp`` writes the backward: a ``lax.scan`` over the same chunks
recomputes one chunk's logits at a time, forms ``(softmax - onehot) g`` from the saved
log-sum-exp (no max or sum is recomputed, so no all-reduce is re-run), and sums the output
matrix's gradient in float32 in the scan's carry. No ``[B, T, V]`` buffer exists forward or
backward.

Chunk ``j`` holds positions ``j, j + n, j + 2n, ...`` (a stride, not a block): a sequence
split over devices in blocks (context and sequence parallelism) keeps its split inside every
chunk, so no chunk gathers positions from other devices. The mean over positions does not
depend on which chunk a position is in.

Each chunk's loss is :func:`parallax.nn.loss.cross_entropy`, written so that GSPMD, when a
strategy splits the vocabulary (``px.TensorParallel``: ``W`` split by rows), partitions it into
Megatron's three all-reduces of ``[B, T / n]`` per chunk: ``3 B T`` float32 numbers per step in
all, as the unchunked loss sends, never logits. Inside ``shard_map`` over the tensor axis (the
explicit layers) it is :func:`parallax.nn.loss.vocab_parallel_cross_entropy`, which issues the
three itself.

References:
  Shoeybi et al., "Megatron-LM", 2019, section 3 (vocabulary-parallel cross-entropy);
  Wijmans et al., "Cut Your Losses in Large-Vocabulary Language Models", 2024, and Hsu et al.,
  "Liger Kernel", 2024 (the loss without materialised logits; the chunk-size rule).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from parallax.activations import constrain
from parallax.comm.varying import to_varying, varying_axes
from parallax.nn import regions
from parallax.nn.loss import cross_entropy_and_lse, vocab_parallel_losses_and_lse
from parallax.nn.padding import mask_padded_logits

LOGITS = ("batch", None, "vocab")  # split by vocabulary, never by sequence (as the models')


def default_chunks(length: int, vocab: int, width: int) -> int:
    """How many chunks :func:`chunked_cross_entropy` splits ``length`` positions into.

    The smallest divisor of ``length`` that is at least ``vocab / width``: then one chunk's
    logits ``[B, T / n, V]`` hold no more numbers than the hidden states ``[B, T, D]`` (the
    rule of Liger Kernel's fused linear cross-entropy), so the loss adds at most about the
    hidden states' size to a step's memory however large the vocabulary.

    Example:
      >>> default_chunks(1024, 50304, 768)   # GPT-2: 66 rounded up to a divisor of 1024
      128
      >>> default_chunks(64, 256, 64)
      4
    """
    least = max(1, math.ceil(vocab / max(width, 1)))
    return next(n for n in range(min(least, length), length + 1) if length % n == 0)


def check_loss_chunks(api: str, chunks, name: str = "loss_chunks") -> None:
    """Raises unless ``chunks`` is None or a positive int (a model config's ``loss_chunks``).

    Example:
      >>> check_loss_chunks("GPTConfig", 0)
      Traceback (most recent call last):
      ...
      ValueError: GPTConfig: loss_chunks must be None (chosen per sequence length) or a positive int, got 0; e.g. loss_chunks=1 computes all logits at once.
    """
    if chunks is not None and (isinstance(chunks, bool) or not isinstance(chunks, int)
                               or chunks < 1):
        raise ValueError(f"{api}: {name} must be None (chosen per sequence length) or a "
                         f"positive int, got {chunks!r}; e.g. {name}=1 computes all logits at "
                         "once.")


def _check(api, hidden, table, labels, transposed):
    if hidden.ndim < 2:
        raise ValueError(f"{api}: hidden states must be [..., T, D], got shape "
                         f"{tuple(hidden.shape)}.")
    width = table.shape[0] if transposed else table.shape[-1]
    if table.ndim != 2 or width != hidden.shape[-1]:
        layout = "[D, V]" if transposed else "[V, D]"
        raise ValueError(f"{api}: the output matrix must be {layout} with D = {hidden.shape[-1]} "
                         f"(the hidden states' last dimension), got shape {tuple(table.shape)}.")
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"{api}: labels have shape {tuple(labels.shape)} but hidden states "
                         f"{tuple(hidden.shape)}; labels need the hidden states' shape without "
                         "the last (feature) axis.")


def chunked_cross_entropy(hidden: jax.Array, table: jax.Array, labels: jax.Array, *,
                          transposed: bool = False, vocab_size: int | None = None,
                          chunks: int | None = None, axis: str = "tensor") -> jax.Array:
    """Softmax cross-entropy of ``hidden @ table.T`` per position, logits a chunk at a time.

    Args:
      hidden: ``[B, T, D]`` hidden states after the final norm (any float dtype; the matmul
        runs in it and accumulates in float32).
      table: the output matrix ``[V, D]`` (a tied embedding), or ``[D, V]`` with
        ``transposed=True`` (a separate head). Inside ``shard_map`` over ``axis`` (the explicit
        layers) this rank's vocabulary slice.
      labels: int target ids ``[B, T]``.
      transposed: ``table`` is ``[D, V]``.
      vocab_size: the real vocabulary when ``table`` is padded: logits of ids
        ``>= vocab_size`` are masked (:func:`parallax.nn.padding.mask_padded_logits`).
      chunks: how many chunks to split the ``T`` positions into (a divisor of ``T``); None
        picks :func:`default_chunks`; 1 computes all logits at once, as without chunking.
      axis: the tensor-parallel mesh axis, read only inside ``shard_map`` over it.

    Returns:
      float32 losses ``[B, T]``: ``logsumexp(logits) - logits[label]``, equal to
      ``cross_entropy(hidden @ table.T, labels)``.

    Raises:
      ValueError: shapes that do not fit, or ``chunks`` not dividing ``T``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from parallax.nn.loss import cross_entropy
      >>> x = jax.random.normal(jax.random.key(0), (2, 8, 4))
      >>> w = jax.random.normal(jax.random.key(1), (16, 4))
      >>> y = jnp.arange(16).reshape(2, 8)
      >>> whole = cross_entropy(jnp.einsum("btd,vd->btv", x, w), y)
      >>> bool(jnp.allclose(chunked_cross_entropy(x, w, y, chunks=4), whole, rtol=1e-6))
      True

    References:
      Shoeybi et al., "Megatron-LM", 2019; Wijmans et al., "Cut Your Losses", 2024.
    """
    api = "px.nn.chunked_cross_entropy"
    _check(api, hidden, table, labels, transposed)
    check_loss_chunks(api, chunks, "chunks")
    *lead, length, width = hidden.shape
    head = _Head(transposed, vocab_size, axis, regions.is_manual(axis))
    local = table.shape[-1] if transposed else table.shape[0]
    n = default_chunks(length, local * regions.axis_size(axis), width) if chunks is None \
        else chunks
    if length % n:
        raise ValueError(f"{api}: {n} loss chunks do not divide the sequence length {length} "
                         f"(hidden states {tuple(hidden.shape)}); use a divisor of {length} "
                         "(the models' loss_chunks), or None to let it choose.")
    if n == 1:  # all logits at once, differentiated by JAX: the unchunked loss exactly
        return head.losses_and_lse(hidden, table, labels)[0]
    # [..., T, D] -> [n, ..., T / n, D]: chunk j holds positions j, j + n, ...
    k = len(lead)
    xs = jnp.moveaxis(hidden.reshape(*lead, length // n, n, width), k + 1, 0)
    ys = jnp.moveaxis(labels.reshape(*lead, length // n, n), k + 1, 0)
    with jax.named_scope("chunked_cross_entropy"):
        losses = _chunked(head, xs, table, ys)  # [n, ..., T / n]
    return jnp.moveaxis(losses, 0, k + 1).reshape(*lead, length)


@dataclasses.dataclass(frozen=True)
class _Head:
    """The static part of the loss: the output matrix's layout, padding and tensor axis."""

    transposed: bool
    vocab_size: int | None
    axis: str
    manual: bool

    def logits(self, x: jax.Array, table: jax.Array) -> jax.Array:
        """float32 logits of one chunk (this rank's vocabulary slice inside ``shard_map``)."""
        spec = "...d,dv->...v" if self.transposed else "...d,vd->...v"
        logits = jnp.einsum(spec, x, table, preferred_element_type=jnp.float32)
        if self.vocab_size is not None:
            logits = mask_padded_logits(logits, self.vocab_size, self.first_id(logits))
        return logits if self.manual else constrain(logits, LOGITS[-logits.ndim:])

    def first_id(self, logits: jax.Array):
        """The id of this rank's first logit (0 outside ``shard_map``)."""
        return regions.axis_index(self.axis) * logits.shape[-1] if self.manual else 0

    def losses_and_lse(self, x, table, y):
        logits = self.logits(x, table)
        if self.manual:
            return vocab_parallel_losses_and_lse(logits, y, self.axis)
        return cross_entropy_and_lse(logits, y)

    def grads(self, x, table, y, lse, g):
        """``(d x, d table in float32)`` of one chunk: the logits recomputed, their gradient
        ``(softmax - onehot) g`` from the saved log-sum-exp, no communication (inside
        ``shard_map`` the caller's ``f`` all-reduces ``d x``; under GSPMD, XLA does)."""
        logits = self.logits(x, table)
        ids = self.first_id(logits) + jnp.arange(logits.shape[-1], dtype=y.dtype)
        probs = jnp.exp(logits - lse[..., None])
        dlogits = (probs - (ids == y[..., None])) * g[..., None]
        if not self.manual:
            dlogits = constrain(dlogits, LOGITS[-dlogits.ndim:])
        if self.transposed:
            dx = jnp.einsum("...v,dv->...d", dlogits.astype(table.dtype), table,
                            preferred_element_type=jnp.float32)
            dtable = jnp.einsum("...d,...v->dv", x, dlogits.astype(x.dtype),
                                preferred_element_type=jnp.float32)
        else:
            dx = jnp.einsum("...v,vd->...d", dlogits.astype(table.dtype), table,
                            preferred_element_type=jnp.float32)
            dtable = jnp.einsum("...v,...d->vd", dlogits.astype(x.dtype), x,
                                preferred_element_type=jnp.float32)
        return dx.astype(x.dtype), dtable


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunked(head: _Head, xs, table, ys):
    return _chunked_forward(head, xs, table, ys)[0]


def _chunked_forward(head: _Head, xs, table, ys):
    losses, lse = lax.map(lambda xy: head.losses_and_lse(xy[0], table, xy[1]), (xs, ys))
    return losses, (xs, table, ys, lse)


def _chunked_backward(head: _Head, saved, g):
    xs, table, ys, lse = saved

    def step(dtable, chunk):
        x, y, lse_chunk, g_chunk = chunk
        dx, d = head.grads(x, table, y, lse_chunk, g_chunk)
        return dtable + d, dx

    # Inside shard_map the sum varies over every manual axis its terms vary over.
    axes = frozenset().union(*(varying_axes(a) for a in (xs, table, ys, lse, g)))
    start = to_varying(jnp.zeros(table.shape, jnp.float32), sorted(axes))
    with jax.named_scope("chunked_cross_entropy"):
        dtable, dxs = lax.scan(step, start, (xs, ys, lse, g))
    return _as_cotangent(dxs, xs), _as_cotangent(dtable.astype(table.dtype), table), None


def _as_cotangent(ct, primal):
    """``ct`` summed over the manual axes it varies over and ``primal`` does not: the
    transpose of the implicit cast an invariant input gets when it meets a varying one, as
    JAX's own autodiff inserts it (an input that entered through ``f`` varies already)."""
    extra = tuple(sorted(varying_axes(ct) - varying_axes(primal)))
    return lax.psum(ct, extra) if extra else ct


_chunked.defvjp(_chunked_forward, _chunked_backward)
