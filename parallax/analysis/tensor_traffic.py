"""Megatron's traffic: what the papers say a GPT step sends over the tensor axis, and what
a compiled program really sends.

:func:`megatron_traffic` is the formula (Shoeybi et al. 2019, Korthikanti et al. 2022 for
sequence parallelism); :func:`measured_traffic` and :func:`tensor_collectives` read the same
quantities from the partitioned HLO, so a test or ``benchmarks/tensor_parallel.py`` can put
the two side by side. The strategy itself is ``parallax.strategies.tensor``.

References:
  Shoeybi et al., "Megatron-LM", 2019. Korthikanti et al., "Reducing Activation
  Recomputation in Large Transformer Models", 2022.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax.numpy as jnp

from parallax.analysis import hlo


@dataclasses.dataclass(frozen=True)
class TensorTraffic:
    """Message bytes per step over the tensor axis, by collective (nccl-tests' "size").

    ``wire_bytes(n)`` is what each device sends on a ring of ``n``: ``2 (n-1)/n`` of an
    all-reduce's message, ``(n-1)/n`` of an all-gather's or reduce-scatter's. An all-reduce
    is a reduce-scatter plus an all-gather, so sequence parallelism, which replaces each
    all-reduce by that pair, sends the same bytes.
    """

    all_reduce: int = 0
    all_gather: int = 0
    reduce_scatter: int = 0

    @property
    def message_bytes(self) -> int:
        return self.all_reduce + self.all_gather + self.reduce_scatter

    def wire_bytes(self, n: int) -> float:
        return (n - 1) / n * (2 * self.all_reduce + self.all_gather + self.reduce_scatter)


def megatron_traffic(config, batch: int, seq_len: int | None = None, *,
                     sequence_parallel: bool = False) -> TensorTraffic:
    """What the Megatron papers say a GPT training step sends over the tensor axis.

    Per layer, attention and MLP each need one all-reduce of the ``[B, T, D]`` activations
    forward and one backward (Shoeybi et al., section 3); the vocabulary-parallel
    embedding one forward, the tied output layer one backward, and the vocabulary-parallel
    loss three of ``[B, T]`` float32 scalars (max, sum of exponentials, target logit).
    With sequence parallelism (Korthikanti et al.) each layer all-reduce becomes a
    reduce-scatter and an all-gather; the embedding still all-reduces, then splits the
    sequence (backward: all-gather), and the output layer all-gathers the sequence
    (backward: reduce-scatter). Only activations are counted: the small all-reduces of
    LayerNorm and bias gradients under sequence parallelism (``O(L D)`` bytes) are not.

    Args:
      config: a ``px.models.GPTConfig``.
      batch: examples per tensor-parallel group (the global batch over the data-like axes).
      seq_len: T; ``config.max_seq_len`` when None.
      sequence_parallel: with sequence parallelism.

    Returns:
      A :class:`TensorTraffic`.

    Example:
      >>> import parallax as px
      >>> from parallax.analysis.tensor_traffic import megatron_traffic
      >>> t = megatron_traffic(px.models.GPTConfig.tiny(), batch=16)
      >>> t.all_reduce == (4 * 2 + 2) * 16 * 64 * 64 * 4 + 3 * 16 * 64 * 4
      True
      >>> sp = megatron_traffic(px.models.GPTConfig.tiny(), batch=16, sequence_parallel=True)
      >>> sp.all_gather == sp.reduce_scatter + 16 * 64 * 64 * 4
      True
    """
    t = config.max_seq_len if seq_len is None else seq_len
    tokens, layers = batch * t, config.num_layers
    act = tokens * config.embed_dim * jnp.dtype(config.dtype).itemsize
    loss = 3 * tokens * 4
    if not sequence_parallel:
        return TensorTraffic(all_reduce=(4 * layers + 2) * act + loss)
    return TensorTraffic(all_reduce=act + loss, all_gather=(4 * layers + 2) * act,
                   reduce_scatter=(4 * layers + 1) * act)


class TensorCollective(NamedTuple):
    """A collective over the tensor axis, with where it runs."""

    collective: hlo.Collective
    phase: str  # "forward" or "backward" (from the op_name of its HLO metadata)
    in_loop: bool  # inside a while body: once per scanned layer


def tensor_collectives(compiled, mesh, axis: str = "tensor") -> list[TensorCollective]:
    """The collectives of a compiled step over exactly ``axis``, by phase and place.

    A collective belongs to the backward pass when JAX's op_name metadata says it was
    made by a ``transpose``; it runs once per layer when it sits in a while body (the
    scan over stacked blocks) rather than in the entry computation.
    """
    return [
        TensorCollective(c, "backward" if "transpose(" in c.op_name else "forward",
                         not c.in_entry)
        for c in hlo.collectives(compiled, mesh) if c.axes == (axis,)
    ]


def _array_bytes(c: hlo.Collective, dtype: str, shape) -> int:
    size = math.prod(shape) * hlo.DTYPE_BYTES[dtype]
    return int(size * (c.group_size if c.kind == "reduce-scatter" else 1))


def measured_traffic(compiled, mesh, batch: int, axis: str = "tensor") -> TensorTraffic:
    """The activation traffic of a compiled step over ``axis``, comparable to the formula.

    Counts every array moved over ``axis`` whose leading dimension is ``batch`` (the
    examples of one tensor-parallel group): activations, not the ``[D]``-sized LayerNorm
    and bias gradients of sequence parallelism. Each is multiplied by how often it runs.
    """
    totals = {"all-reduce": 0, "all-gather": 0, "reduce-scatter": 0}
    for tc in tensor_collectives(compiled, mesh, axis):
        c = tc.collective
        for dtype, shape in zip(c.dtypes, c.shapes):
            if c.kind in totals and len(shape) >= 2 and shape[0] == batch:
                totals[c.kind] += c.count * _array_bytes(c, dtype, shape)
    return TensorTraffic(totals["all-reduce"], totals["all-gather"], totals["reduce-scatter"])
