"""Megatron's vocabulary-parallel embedding, and the tied output logits it gives.

The table ``[V, D]`` is split by rows: rank ``r`` owns token ids ``[r V/T, (r+1) V/T)``. A
lookup finds the ids it owns, writes zeros for the others, and the partial results are
summed with ``g`` (an all-reduce; under sequence parallelism a reduce-scatter along the
sequence). The tied output projection ``x . table^T`` gives each rank the logits of its
own ids ``[..., V/T]`` after ``f``: the full logits never exist on one device, and
:func:`parallax.nn.vocab_parallel_cross_entropy` takes the loss from the slices.

A vocabulary that does not split evenly is padded (``pad_to_multiple_of``), as Megatron's
``make_vocab_size_divisible_by`` does: the extra rows start at zero, are never looked up,
and their logits are masked to the lowest float, so the loss and every gradient are those
of the unpadded model.

References:
  Shoeybi et al., "Megatron-LM", 2019, section 3 (parallel input and output embeddings).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from parallax.nn.layers import annotated_param
from parallax.nn.padding import mask_padded_logits, padded_init, padded_size
from parallax.nn import regions

Initializer = nnx.initializers.Initializer


def _vocab_start(local: int, axis: str):
    return regions.axis_index(axis) * local


def vocab_parallel_embed(table: jax.Array, ids: jax.Array, *, axis: str = "tensor",
                         sequence_parallel: bool = False, sequence_dim: int = 1) -> jax.Array:
    """Looks ``ids`` up in a row-split ``table``: masked local lookup, then ``g``.

    Args:
      table: ``[V, D]`` (inside ``shard_map``: this rank's ``[V/T, D]`` rows).
      ids: int token ids, the same on every rank.
      axis: the tensor-parallel mesh axis.
      sequence_parallel: reduce-scatter the result along ``sequence_dim`` instead of
        all-reducing it (the output is this rank's part of the sequence).
      sequence_dim: the sequence dimension of the output.

    Returns:
      ``table[ids]``, ``ids.shape + (D,)`` (or this rank's sequence part).
    """
    if not regions.is_manual(axis):
        return jnp.take(table, ids, axis=0)
    local = table.shape[0]
    offset = ids - _vocab_start(local, axis)
    inside = (offset >= 0) & (offset < local)
    rows = jnp.take(table, jnp.where(inside, offset, 0), axis=0)
    rows = jnp.where(inside[..., None], rows, jnp.zeros_like(rows))
    if sequence_parallel:
        return regions.reduce_scatter_to_sequence(rows, axis, sequence_dim)
    return regions.reduce_from_tensor(rows, axis)


def vocab_parallel_logits(x: jax.Array, table: jax.Array, *, axis: str = "tensor",
                          vocab_size: int | None = None, sequence_parallel: bool = False,
                          sequence_dim: int = 1, transposed: bool = False) -> jax.Array:
    """This rank's logits ``x . table^T`` over its slice of the vocabulary, in float32.

    Args:
      x: ``[..., D]`` hidden states, replicated over ``axis`` (or split along the sequence
        with ``sequence_parallel``: they are all-gathered first).
      table: ``[V, D]`` (tied embedding; ``transposed``: an output kernel ``[D, V]``), this
        rank's rows inside ``shard_map``.
      axis: the tensor-parallel mesh axis.
      vocab_size: the real vocabulary; logits of padded ids ``>= vocab_size`` are masked.
      sequence_parallel: ``x`` is split along ``sequence_dim``.
      sequence_dim: the sequence dimension of ``x``.
      transposed: ``table`` is ``[D, V]``.

    Returns:
      float32 logits ``[..., V/T]`` (``[..., V]`` outside a manual region).
    """
    if sequence_parallel:
        x = regions.gather_from_sequence(x, axis, sequence_dim)
    else:
        x = regions.copy_to_tensor(x, axis)
    w = jnp.asarray(table, x.dtype)
    spec = "...d,dv->...v" if transposed else "...d,vd->...v"
    logits = jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)
    local = logits.shape[-1]
    if vocab_size is not None and vocab_size < local * regions.axis_size(axis):
        logits = mask_padded_logits(logits, vocab_size, _vocab_start(local, axis))
    return logits


class VocabParallelEmbedding(nnx.Module):
    """A token embedding whose rows are split over the tensor-parallel ranks.

    Args:
      num_embeddings: V, the vocabulary size.
      features: D, the embedding width.
      rngs: the ``nnx.Rngs`` for the table.
      axis: the tensor-parallel mesh axis.
      sequence_parallel: the lookup ends in a reduce-scatter along the sequence (dimension
        1 of ``[batch, seq]`` ids); :meth:`attend` all-gathers its input first.
      pad_to_multiple_of: pad the table to a multiple of this many rows (use the tensor
        size, or 128 as Megatron does).
      embedding_init: init of the real rows (normal(0.02), as GPT-2); padded rows are zero.
      names: logical names of the table (``"vocab"`` is what ``px.TensorParallel`` splits).
      param_dtype: storage dtype.

    Example:
      >>> import jax.numpy as jnp, parallax.nn
      >>> from flax import nnx
      >>> emb = parallax.nn.VocabParallelEmbedding(250, 8, pad_to_multiple_of=4,
      ...                                          rngs=nnx.Rngs(0))
      >>> emb.embedding.shape, emb(jnp.zeros((2, 3), jnp.int32)).shape
      ((252, 8), (2, 3, 8))
      >>> emb.attend(jnp.ones((2, 3, 8))).shape    # padded logits masked
      (2, 3, 252)

    References:
      Shoeybi et al., "Megatron-LM", 2019, section 3.
    """

    def __init__(self, num_embeddings: int, features: int, *, rngs: nnx.Rngs,
                 axis: str = "tensor", sequence_parallel: bool = False,
                 pad_to_multiple_of: int = 1,
                 embedding_init: Initializer = nnx.initializers.normal(0.02),
                 names: tuple[str, str] = ("vocab", "embed"), param_dtype=jnp.float32):
        self.num_embeddings, self.features = num_embeddings, features
        self.axis, self.sequence_parallel = axis, sequence_parallel
        rows = padded_size(num_embeddings, pad_to_multiple_of)
        self.embedding = annotated_param(padded_init(embedding_init, num_embeddings),
                                         rngs.params(), (rows, features), names, param_dtype)

    def __call__(self, ids: jax.Array) -> jax.Array:
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise TypeError(f"VocabParallelEmbedding: ids must be integers, got {ids.dtype}.")
        return vocab_parallel_embed(self.embedding[...], ids, axis=self.axis,
                                    sequence_parallel=self.sequence_parallel)

    def attend(self, x: jax.Array) -> jax.Array:
        """Tied output logits of this rank's ids (float32; padded ids masked)."""
        return vocab_parallel_logits(x, self.embedding[...], axis=self.axis,
                                     vocab_size=self.num_embeddings,
                                     sequence_parallel=self.sequence_parallel)
