"""Megatron's conjugate communication operators, explicit and named, for ``jax.shard_map``.

A tensor-parallel layer enters and leaves a *region* where each rank holds a slice of the
activations. Megatron writes each boundary as an operator whose backward is the transpose of
its forward (Shoeybi et al. call the first pair ``f`` and ``g``):

=============================  ==============================  ==============================
operator                       forward                         backward
=============================  ==============================  ==============================
``copy_to_tensor`` (``f``)     identity                        all-reduce
``reduce_from_tensor`` (``g``) all-reduce                      identity
``scatter_to_tensor``          keep this rank's slice          all-gather
``gather_from_tensor``         all-gather                      keep this rank's slice
``scatter_to_sequence``        keep this rank's sequence part  all-gather along the sequence
``gather_from_sequence``       all-gather along the sequence   reduce-scatter
``reduce_scatter_to_sequence`` reduce-scatter along sequence   all-gather
=============================  ==============================  ==============================

The last three are sequence parallelism (Korthikanti et al.): LayerNorm and dropout run on
``1/T`` of the sequence, and each all-reduce of plain tensor parallelism becomes a
reduce-scatter followed (at the next column-parallel layer) by an all-gather, moving the same
bytes on a ring.

Each operator is a ``jax.custom_vjp`` whose backward is written out. Inside a ``shard_map``
that is manual over ``axis`` the collectives come from :mod:`parallax.comm`; anywhere else
(one device, or a GSPMD program) every operator is the identity, so a layer built from them
is the plain layer. They assume ``shard_map``'s default ``check_vma=True``: the results are
typed *varying* or *invariant* over ``axis`` as in the table (``f`` makes its input varying,
``g`` makes it invariant), which is also what JAX's own transposes of ``pcast`` and ``psum``
are.

Example:
  >>> import jax, jax.numpy as jnp, parallax as px, parallax.nn
  >>> mesh = px.make_mesh(tensor=4, devices=jax.devices()[:4])
  >>> def column_then_row(x, w1, w2):       # Megatron's MLP: f, two local matmuls, g
  ...     h = px.nn.copy_to_tensor(x, "tensor") @ w1
  ...     return px.nn.reduce_from_tensor(h @ w2, "tensor")
  >>> f = jax.shard_map(column_then_row, mesh=mesh, out_specs=jax.P(),
  ...                   in_specs=(jax.P(), jax.P(None, "tensor"), jax.P("tensor", None)))
  >>> x, w1, w2 = jnp.ones((2, 8)), jnp.ones((8, 16)), jnp.ones((16, 8))
  >>> bool(jnp.allclose(jax.jit(f)(x, w1, w2), x @ w1 @ w2))
  True

(Just over 300 lines: the seven operators are one table, each a few lines on one shared
``custom_vjp`` builder; split, the table would span two files.)

References:
  Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
  Parallelism", 2019 (``f`` and ``g``, figure 3). Korthikanti et al., "Reducing Activation
  Recomputation in Large Transformer Models", 2022 (sequence parallelism, ``g`` and
  ``g-bar``, figure 5).
"""

from __future__ import annotations

import functools

import jax
from jax import lax

from parallax import comm
from parallax.comm.varying import to_varying, varying_axes

__all__ = [
    "axis_index",
    "axis_size",
    "copy_to_tensor",
    "gather_from_sequence",
    "gather_from_tensor",
    "is_manual",
    "reduce_from_tensor",
    "reduce_scatter_to_sequence",
    "scatter_to_sequence",
    "scatter_to_tensor",
]


def is_manual(axis: str) -> bool:
    """True inside a ``shard_map`` that is manual over ``axis`` (a tensor-parallel region).

    Example:
      >>> import parallax.nn
      >>> parallax.nn.is_manual("tensor")   # plain code: the layers are the dense layers
      False
    """
    return axis in (getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()) or ())


def axis_size(axis: str) -> int:
    """The number of tensor-parallel ranks: ``axis``'s size when manual, else 1."""
    return int(lax.axis_size(axis)) if is_manual(axis) else 1


def axis_index(axis: str):
    """This rank's index along ``axis`` when manual, else 0."""
    return lax.axis_index(axis) if is_manual(axis) else 0


def _dim(x, dim: int) -> int:
    return dim % x.ndim


def _check_split(api: str, x, dim: int, axis: str, what: str, fix: str) -> int:
    n = axis_size(axis)
    d = _dim(x, dim)
    if x.shape[d] % n:
        raise ValueError(
            f"px.nn.{api}: the activation of shape {tuple(x.shape)} has {x.shape[d]} "
            f"{what} along dimension {d}, which does not split over {axis}={n} ranks; {fix}"
        )
    return d


def _local_slice(x, axis: str, dim: int):
    n = x.shape[dim] // axis_size(axis)
    return lax.dynamic_slice_in_dim(x, axis_index(axis) * n, n, axis=dim)


def _match(x, axis: str, varying: bool):
    return to_varying(x, axis) if varying else x


def _pair(name, forward, backward):
    """A ``custom_vjp`` operator ``op(x, axis, dim)``: ``forward``, and ``backward`` for it.

    ``backward(ct, axis, dim, was_varying)`` gets whether the input was typed varying, so
    that the gradient it returns has the input's type. Both run under the named scope
    ``parallax/tensor_<name>`` (forward) and ``.../<name>_grad`` (backward), which names
    their collectives in the compiled program and in profiles.
    """
    scope = f"parallax/tensor_{name}"

    @functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
    def op(x, axis, dim):
        with jax.named_scope(scope):
            return forward(x, axis, dim)

    def op_fwd(x, axis, dim):
        with jax.named_scope(scope):
            return forward(x, axis, dim), axis in varying_axes(x)

    def op_bwd(axis, dim, was_varying, ct):
        with jax.named_scope(f"{scope}_grad"):
            return (backward(ct, axis, dim, was_varying),)

    op.defvjp(op_fwd, op_bwd)
    return op


# Each operator next to its transpose: the table of the module docstring.
_copy = _pair("f", lambda x, a, d: to_varying(x, a),
              lambda ct, a, d, v: _match(comm.all_reduce(ct, a), a, v))
_reduce = _pair("g", lambda x, a, d: comm.all_reduce(x, a),
                lambda ct, a, d, v: to_varying(ct, a))
_scatter = _pair("scatter", lambda x, a, d: _local_slice(to_varying(x, a), a, d),
                 lambda ct, a, d, v: comm.all_gather(ct, a, dim=d, invariant=not v))
_gather = _pair("gather", lambda x, a, d: comm.all_gather(x, a, dim=d, invariant=True),
                lambda ct, a, d, v: _local_slice(to_varying(ct, a), a, d))
_seq_gather = _pair("sequence_gather", lambda x, a, d: comm.all_gather(x, a, dim=d),
                    lambda ct, a, d, v: comm.reduce_scatter(ct, a, dim=d))
_seq_reduce_scatter = _pair("sequence_reduce_scatter",
                            lambda x, a, d: comm.reduce_scatter(x, a, dim=d),
                            lambda ct, a, d, v: comm.all_gather(ct, a, dim=d))


def copy_to_tensor(x: jax.Array, axis: str = "tensor") -> jax.Array:
    """Megatron's ``f``: identity forward, all-reduce of the gradient backward.

    Put it where a replicated activation enters a column-parallel layer: every rank uses the
    whole input, and each rank's gradient with respect to it is only the part that flows
    through its own columns, so the gradients are summed.

    Args:
      x: a replicated activation (the same on every rank).
      axis: the tensor-parallel mesh axis.

    Returns:
      ``x``, typed varying over ``axis`` inside ``shard_map``; ``x`` itself elsewhere.
    """
    return _copy(x, axis, 0) if is_manual(axis) else x


def reduce_from_tensor(x: jax.Array, axis: str = "tensor") -> jax.Array:
    """Megatron's ``g``: all-reduce forward, identity backward.

    Put it where a row-parallel layer leaves the region: each rank holds a partial sum
    over its slice of the contracted dimension.

    Args:
      x: this rank's partial sum.
      axis: the tensor-parallel mesh axis.

    Returns:
      The sum over ``axis`` (invariant); ``x`` itself outside a manual region.
    """
    return _reduce(x, axis, 0) if is_manual(axis) else x


def scatter_to_tensor(x: jax.Array, axis: str = "tensor", dim: int = -1) -> jax.Array:
    """Keeps this rank's slice of ``dim`` forward; all-gathers the gradient backward.

    Used by a row-parallel layer whose input is not already split
    (``RowParallelLinear(input_is_parallel=False)``).

    Args:
      x: a replicated activation.
      axis: the tensor-parallel mesh axis.
      dim: the dimension to split; its size must divide by the axis size.

    Returns:
      The local slice (``x`` itself outside a manual region).
    """
    if not is_manual(axis):
        return x
    d = _check_split("scatter_to_tensor", x, dim, axis, "features",
                     "make that dimension a multiple of the tensor-parallel size.")
    return _scatter(x, axis, d)


def gather_from_tensor(x: jax.Array, axis: str = "tensor", dim: int = -1) -> jax.Array:
    """All-gathers the slices along ``dim`` forward; keeps this rank's slice backward.

    Used by ``ColumnParallelLinear(gather_output=True)``: the gathered output is replicated
    (invariant), so its gradient is the same on every rank and each keeps its own part.

    Args:
      x: this rank's slice.
      axis: the tensor-parallel mesh axis.
      dim: where the slices are concatenated.

    Returns:
      The whole activation, the same on every rank (``x`` outside a manual region).
    """
    return _gather(x, axis, _dim(x, dim)) if is_manual(axis) else x


# ---- sequence parallelism -----------------------------------------------------------------

_SEQ_FIX = ("use a sequence length that is a multiple of the tensor-parallel size "
            "(sequence parallelism splits the sequence over the tensor axis), or turn "
            "sequence_parallel off.")


def scatter_to_sequence(x: jax.Array, axis: str = "tensor", dim: int = 1) -> jax.Array:
    """Enters a sequence-parallel region: keeps this rank's part of the sequence.

    Forward is a local slice (no communication); backward all-gathers the gradient along the
    sequence. Megatron uses it after the embedding.

    Args:
      x: a replicated activation ``[batch, sequence, ...]``.
      axis: the tensor-parallel mesh axis.
      dim: the sequence dimension (1 for ``[batch, sequence, hidden]``).

    Returns:
      ``x[:, r * T / n : (r + 1) * T / n]`` on rank ``r`` (``x`` outside a manual region).

    Raises:
      ValueError: the sequence length does not divide by the axis size.
    """
    if not is_manual(axis):
        return x
    d = _check_split("scatter_to_sequence", x, dim, axis, "positions", _SEQ_FIX)
    return _scatter(x, axis, d)


def gather_from_sequence(x: jax.Array, axis: str = "tensor", dim: int = 1) -> jax.Array:
    """Leaves a sequence-parallel region before a column-parallel layer.

    Forward all-gathers the sequence; backward reduce-scatters the gradient (each rank's
    columns contribute a partial gradient for every position).

    Args:
      x: this rank's part of the sequence.
      axis: the tensor-parallel mesh axis.
      dim: the sequence dimension.

    Returns:
      The whole sequence (typed varying: the next layer's gradient differs per rank).
    """
    return _seq_gather(x, axis, _dim(x, dim)) if is_manual(axis) else x


def reduce_scatter_to_sequence(x: jax.Array, axis: str = "tensor", dim: int = 1) -> jax.Array:
    """Leaves a row-parallel layer into a sequence-parallel region.

    Forward reduce-scatters the partial sums along the sequence (instead of ``g``'s
    all-reduce); backward all-gathers the gradient.

    Args:
      x: this rank's partial sum over the whole sequence.
      axis: the tensor-parallel mesh axis.
      dim: the sequence dimension.

    Returns:
      The summed activation, this rank's part of the sequence.

    Raises:
      ValueError: the sequence length does not divide by the axis size.
    """
    if not is_manual(axis):
        return x
    d = _check_split("reduce_scatter_to_sequence", x, dim, axis, "positions", _SEQ_FIX)
    return _seq_reduce_scatter(x, axis, d)
