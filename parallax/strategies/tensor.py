"""Tensor (Megatron) parallelism: the rule table for GSPMD, its checks and its traffic formula.

``TensorParallel(axis)`` maps the logical axes ``"heads"``, ``"mlp"`` and ``"vocab"`` to
``axis``. On a model annotated like ``px.models.GPT`` that is Megatron's layout, and XLA
inserts Megatron's collectives: per transformer layer one all-reduce of the ``[B, T, D]``
activations after attention and one after the MLP, and one each in the backward pass; with
``sequence_parallel=True`` each becomes a reduce-scatter plus an all-gather. The explicit
form (``shard_map`` with Megatron's ``f``/``g`` operators) is ``parallax.nn``; see
``docs/tensor_parallel.md``.

This module also holds what both forms share: the divisibility checks with Megatron-specific
fixes (:func:`sharded_dims`, :func:`check_params`), the bytes the Megatron papers say a GPT
step communicates (:func:`megatron_traffic`) and the same numbers read from a compiled
program (:func:`measured_traffic`, :func:`tensor_collectives`).

References:
  Shoeybi et al., "Megatron-LM", 2019. Narayanan et al., "Efficient Large-Scale Language
  Model Training on GPU Clusters Using Megatron-LM", 2021. Korthikanti et al., "Reducing
  Activation Recomputation in Large Transformer Models", 2022 (sequence parallelism).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from parallax.analysis import hlo
from parallax.rules import annotated_leaves, as_tuple
from parallax.strategy import Strategy

SPLIT_NAMES = ("heads", "mlp", "vocab")
_FIXES = {
    "heads": "use a number of attention heads that is a multiple of {n}, or a tensor axis "
             "dividing {size}",
    "mlp": "use an MLP width (mlp_dim) that is a multiple of {n}, or a tensor axis dividing "
           "{size}",
    "vocab": "pad the vocabulary to a multiple of {n}: GPTConfig(vocab_pad_multiple={n}) or "
             "VocabParallelEmbedding(..., pad_to_multiple_of={n}); padded logits are masked, "
             "so the loss is unchanged",
    "kv_heads": "use a number of key/value heads that divides {n} or is a multiple of it",
}


def TensorParallel(axis: str = "tensor", *, sequence_parallel: bool = False) -> Strategy:
    """Shards attention heads, the MLP width and the vocabulary over ``axis``.

    ``"embed"`` stays replicated. The query/key/value and MLP input kernels are split by
    columns, the attention output and MLP output kernels by rows. With
    ``sequence_parallel=True`` the residual stream's ``"sequence"`` axis is sharded over
    ``axis`` too (LayerNorm and residual adds on ``1/T`` of the positions).

    Args:
      axis: the mesh axis to shard over.
      sequence_parallel: also shard the sequence of the residual stream.

    Returns:
      A :class:`parallax.Strategy` holding only rules (it does not split the batch).

    Example:
      >>> import parallax as px
      >>> dict(px.TensorParallel("tensor").rules)["mlp"]
      'tensor'
      >>> px.TensorParallel("tensor", sequence_parallel=True).name
      "TensorParallel('tensor', sequence_parallel=True)"

    References:
      Shoeybi et al., "Megatron-LM", 2019. Korthikanti et al., 2022 (sequence parallelism).
    """
    rules = [(name, axis) for name in SPLIT_NAMES]
    if sequence_parallel:
        rules.append(("sequence", axis))
    name = f"TensorParallel({axis!r}" + (", sequence_parallel=True)" if sequence_parallel else ")")
    return Strategy(name=name, rules=tuple(rules), param_checks=(MegatronCheck(axis),))


@dataclasses.dataclass(frozen=True)
class MegatronCheck:
    """``TensorParallel``'s parameter check (a ``Strategy.param_checks`` entry).

    ``px.init``, ``px.shard`` and ``px.train_step`` call it on every annotated parameter, so
    a head count, MLP width or vocabulary that does not split over the tensor axis fails
    with Megatron's fix (e.g. ``GPTConfig(vocab_pad_multiple=...)``) rather than the
    generic layout message. A value, so that equal strategies compare equal.
    """

    axis: str

    def __call__(self, names, shape, mesh, *, path: tuple = (), api: str = "px.TensorParallel"):
        # The rules never split key/value heads ("kv_heads"): GSPMD replicates them, so
        # only the explicit layers (param_specs) need them to divide the tensor size.
        names = tuple(None if n == "kv_heads" else n for n in names)
        if self.axis in mesh.shape:
            sharded_dims(names, shape, self.axis, mesh.shape[self.axis],
                         path=readable_path(path), api=api)


def sharded_dims(names, shape, axis: str, size: int, rules=None, *, path: str = "",
                 api: str = "px.TensorParallel") -> tuple[bool, ...]:
    """Which dimensions of one parameter are split over ``axis`` (``size`` ranks).

    A dimension is split when ``rules`` maps its logical name to ``axis``. Key/value heads
    of grouped-query attention (``"kv_heads"``) are split when they divide by ``size`` and
    replicated when there are fewer (``size`` a multiple of them).

    Raises:
      ValueError: a split dimension does not divide by ``size``; the message names the
        API, the path, the shape, the mesh axis and size, and a fix for heads, MLP width
        and vocabulary (padding).
    """
    rules = dict(TensorParallel(axis).rules) if rules is None else rules
    out = []
    for dim, (name, length) in enumerate(zip(names or (None,) * len(shape), shape)):
        split = name is not None and axis in as_tuple(rules.get(name))
        if name == "kv_heads":  # grouped-query attention: split, or replicate when fewer
            split = length % size == 0 or size % length != 0
        if split and length % size:
            fix = _FIXES.get(name, "pad that dimension to a multiple of {n}").format(
                n=size, size=length)
            raise ValueError(
                f"{api}: {path or 'a parameter'} has shape {tuple(shape)}: its {name!r} "
                f"dimension {dim} has {length} entries, which do not split over the tensor "
                f"axis {axis}={size}. Fix: {fix}."
            )
        out.append(split)
    return tuple(out)


def check_params(params, mesh, axis: str = "tensor", *, rules=None,
                 api: str = "px.TensorParallel") -> None:
    """Checks every annotated parameter of ``params`` against ``axis`` of ``mesh``.

    Example:
      >>> import parallax as px
      >>> from flax import nnx
      >>> model = nnx.eval_shape(lambda: px.models.GPT(
      ...     px.models.GPTConfig.tiny(num_heads=2, embed_dim=32), rngs=nnx.Rngs(0)))
      >>> px.strategies.tensor.check_params(nnx.state(model), px.make_mesh(tensor=-1))
      Traceback (most recent call last):
      ...
      ValueError: px.TensorParallel: ['blocks']['attn']['key']['kernel'] has shape (2, 32, 2, 16): its 'heads' dimension 2 has 2 entries, which do not split over the tensor axis tensor=8. Fix: use a number of attention heads that is a multiple of 8, or a tensor axis dividing 2.
    """
    size = mesh.shape[axis]
    for leaf in annotated_leaves(params):
        if leaf.names is not None and not leaf.physical:
            sharded_dims(leaf.names, leaf.leaf.shape, axis, size, rules,
                         path=readable_path(leaf.path), api=api)


def readable_path(path: tuple) -> str:
    """``keystr`` of a parameter's path without NNX's trailing ``.value``."""
    return jax.tree_util.keystr(tuple(
        k for k in path if not (isinstance(k, jax.tree_util.GetAttrKey) and k.name == "value")))


@dataclasses.dataclass(frozen=True)
class Traffic:
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
                     sequence_parallel: bool = False) -> Traffic:
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
      A :class:`Traffic`.

    Example:
      >>> import parallax as px
      >>> from parallax.strategies.tensor import megatron_traffic
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
        return Traffic(all_reduce=(4 * layers + 2) * act + loss)
    return Traffic(all_reduce=act + loss, all_gather=(4 * layers + 2) * act,
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


def measured_traffic(compiled, mesh, batch: int, axis: str = "tensor") -> Traffic:
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
    return Traffic(totals["all-reduce"], totals["all-gather"], totals["reduce-scatter"])
