"""Megatron's column- and row-parallel linear layers, and the parallel MLP built from them.

A kernel ``[in, out]`` split by **columns** (``ColumnParallelLinear``) gives each rank
``out / T`` outputs from the whole input: the input enters through ``f`` (identity forward,
all-reduce backward). Split by **rows** (``RowParallelLinear``) each rank contracts its
``in / T`` slice of the input and the partial sums leave through ``g`` (all-reduce forward,
identity backward). A column layer followed by a row layer (``ParallelMLP``) therefore costs
one all-reduce forward and one backward, and nothing between them.

Parameters have their **global** shapes and logical names (like ``px.models``' layers), so
the same module is the plain dense layer on one device, a GSPMD layer under
``px.TensorParallel``'s rules, and, inside a ``shard_map`` manual over ``axis`` (see
``px.nn.tensor_parallel``), the explicit Megatron layer on its local shard.

References:
  Shoeybi et al., "Megatron-LM", 2019, section 3 (column/row parallel GEMMs). Korthikanti
  et al., "Reducing Activation Recomputation in Large Transformer Models", 2022
  (sequence parallelism).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from parallax.nn.layers import annotated_param
from parallax.nn import regions
from parallax.activations import constrain

Initializer = nnx.initializers.Initializer
Shape = int | Sequence[int]


def _shape(s: Shape) -> tuple[int, ...]:
    return (s,) if isinstance(s, int) else tuple(s)


class _Linear(nnx.Module):
    """Shared parts: a kernel ``in_shape + out_shape`` and a bias ``out_shape``."""

    split: int  # which kernel dimension is split over the tensor axis

    def __init__(self, in_features, out_features, names, *, rngs, axis, use_bias, kernel_init,
                 dtype, param_dtype, sequence_parallel, sequence_dim):
        self.in_shape, self.out_shape = _shape(in_features), _shape(out_features)
        shape = self.in_shape + self.out_shape
        names = tuple(names)
        if len(names) != len(shape):
            raise ValueError(
                f"{type(self).__name__}: kernel shape {shape} needs one logical name per "
                f"dimension, got names={names}; pass e.g. names=('embed', 'mlp')."
            )
        self.axis, self.dtype = axis, dtype
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        self.kernel = annotated_param(kernel_init, rngs.params(), shape, names, param_dtype)
        self.bias = annotated_param(
            nnx.initializers.zeros, None, self.out_shape, names[len(self.in_shape):], param_dtype
        ) if use_bias else None

    def _check_local(self):
        """Inside a manual region the split dimension must hold 1/T of its global size."""
        n = regions.axis_size(self.axis)
        full = (self.in_shape + self.out_shape)[self.split]
        local = self.kernel[...].shape[self.split]
        if local * n != full:
            raise ValueError(
                f"{type(self).__name__}: inside shard_map over {self.axis!r} ({self.axis}={n}) "
                f"the kernel has local shape {tuple(self.kernel[...].shape)}, but its split "
                f"dimension {self.split} has {full} entries, so each rank should hold "
                f"{full // n if full % n == 0 else full / n}. Shard the parameters with "
                f"in_specs from px.nn.param_specs(params, mesh, {self.axis!r}) (or use "
                "px.nn.tensor_parallel)."
            )

    def _matmul(self, x):
        dtype = self.dtype or x.dtype
        y = jnp.tensordot(jnp.asarray(x, dtype), jnp.asarray(self.kernel[...], dtype),
                          axes=len(self.in_shape))
        return y, dtype


class ColumnParallelLinear(_Linear):
    """``y = x . kernel + bias`` with the kernel's (first) output dimension split over ranks.

    Args:
      in_features: the contracted trailing dimension(s) of the input (int or tuple).
      out_features: the output dimension(s); the first one with a logical name is split, e.g.
        ``(heads, head_dim)`` for a query projection, ``(3, heads, head_dim)`` named
        ``(None, "heads", "kv")`` for fused q/k/v (each rank its heads of all three).
      rngs: the ``nnx.Rngs`` for the kernel (stream ``params``).
      names: logical names of the kernel, one per dimension of ``in + out``; the split
        dimension's name must be one that ``px.TensorParallel`` shards (``"mlp"``,
        ``"heads"``, ``"vocab"``). Default ``("embed", "mlp")`` for 2-D kernels.
      axis: the tensor-parallel mesh axis.
      gather_output: all-gather the output slices (every rank gets the whole output).
      sequence_parallel: the input is split along the sequence (a sequence-parallel
        region); it is all-gathered first and its gradient reduce-scattered.
      sequence_dim: the input's sequence dimension for ``sequence_parallel``.
      use_bias: add a bias (zeros at init).
      kernel_init: kernel initializer (normal(0.02), as GPT-2).
      dtype: compute dtype; None keeps the input's.
      param_dtype: storage dtype of the parameters.

    Example:
      >>> import jax.numpy as jnp, parallax.nn
      >>> from flax import nnx
      >>> layer = parallax.nn.ColumnParallelLinear(8, 32, rngs=nnx.Rngs(0))
      >>> layer(jnp.ones((2, 8))).shape          # one device: the dense layer
      (2, 32)

    References:
      Shoeybi et al., "Megatron-LM", 2019, equation (3).
    """

    def __init__(self, in_features: Shape, out_features: Shape, *, rngs: nnx.Rngs,
                 names: Sequence[str | None] | None = None, axis: str = "tensor",
                 gather_output: bool = False, sequence_parallel: bool = False,
                 sequence_dim: int = 1, use_bias: bool = True,
                 kernel_init: Initializer = nnx.initializers.normal(0.02),
                 dtype=None, param_dtype=jnp.float32):
        names = ("embed", "mlp") if names is None else names
        super().__init__(in_features, out_features, names, rngs=rngs, axis=axis,
                         use_bias=use_bias, kernel_init=kernel_init, dtype=dtype,
                         param_dtype=param_dtype, sequence_parallel=sequence_parallel,
                         sequence_dim=sequence_dim)
        # the first named output dimension: a stacked axis before it (fused q/k/v) is whole
        n_in = len(self.in_shape)
        self.split = next((n_in + i for i, name in enumerate(tuple(names)[n_in:])
                           if name is not None), n_in)
        self.gather_output = gather_output

    def enter(self, x: jax.Array) -> jax.Array:
        """The input operator: ``f``, or the sequence all-gather under sequence parallelism."""
        if self.sequence_parallel:
            return regions.gather_from_sequence(x, self.axis, self.sequence_dim)
        return regions.copy_to_tensor(x, self.axis)

    def project(self, x: jax.Array) -> jax.Array:
        """The local matmul and bias, no communication (``x`` has entered already)."""
        if regions.is_manual(self.axis):
            self._check_local()
        y, dtype = self._matmul(x)
        return y if self.bias is None else y + jnp.asarray(self.bias[...], dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.project(self.enter(x))
        if self.gather_output:
            first_out = y.ndim - len(self.out_shape)
            return regions.gather_from_tensor(y, self.axis,
                                              first_out + self.split - len(self.in_shape))
        return y


class RowParallelLinear(_Linear):
    """``y = x . kernel + bias`` with the kernel's (first) input dimension split over ranks.

    Args:
      in_features: the contracted dimension(s); the first one is split, e.g.
        ``(heads, head_dim)`` for an attention output projection.
      out_features: the output dimension(s).
      rngs: the ``nnx.Rngs`` for the kernel.
      names: logical names, one per kernel dimension; default ``("mlp", "embed")``.
      axis: the tensor-parallel mesh axis.
      input_is_parallel: the input is already split (it comes from a column-parallel
        layer); otherwise each rank first keeps its slice (backward: all-gather).
      sequence_parallel: leave into a sequence-parallel region: reduce-scatter along the
        sequence instead of ``g``'s all-reduce.
      sequence_dim: the output's sequence dimension for ``sequence_parallel``.
      use_bias: add a bias after the reduction (once, not once per rank).
      kernel_init: kernel initializer.
      dtype: compute dtype; None keeps the input's.
      param_dtype: storage dtype of the parameters.

    Example:
      >>> import jax.numpy as jnp, parallax.nn
      >>> from flax import nnx
      >>> parallax.nn.RowParallelLinear(32, 8, rngs=nnx.Rngs(0))(jnp.ones((2, 32))).shape
      (2, 8)

    References:
      Shoeybi et al., "Megatron-LM", 2019, equation (4).
    """

    split = 0

    def __init__(self, in_features: Shape, out_features: Shape, *, rngs: nnx.Rngs,
                 names: Sequence[str | None] | None = None, axis: str = "tensor",
                 input_is_parallel: bool = True, sequence_parallel: bool = False,
                 sequence_dim: int = 1, use_bias: bool = True,
                 kernel_init: Initializer = nnx.initializers.normal(0.02),
                 dtype=None, param_dtype=jnp.float32):
        names = ("mlp", "embed") if names is None else names
        super().__init__(in_features, out_features, names, rngs=rngs, axis=axis,
                         use_bias=use_bias, kernel_init=kernel_init, dtype=dtype,
                         param_dtype=param_dtype, sequence_parallel=sequence_parallel,
                         sequence_dim=sequence_dim)
        self.input_is_parallel = input_is_parallel

    def __call__(self, x: jax.Array) -> jax.Array:
        manual = regions.is_manual(self.axis)
        if manual:
            self._check_local()
            if not self.input_is_parallel:
                x = regions.scatter_to_tensor(x, self.axis, x.ndim - len(self.in_shape))
        y, dtype = self._matmul(x)
        if self.sequence_parallel:
            y = regions.reduce_scatter_to_sequence(y, self.axis, self.sequence_dim)
        else:
            y = regions.reduce_from_tensor(y, self.axis)
        return y if self.bias is None else y + jnp.asarray(self.bias[...], dtype)


class ParallelMLP(nnx.Module):
    """A transformer MLP: column-parallel ``fc``, activation, row-parallel ``proj``.

    One all-reduce forward and one backward per call (or, with ``sequence_parallel``, an
    all-gather in and a reduce-scatter out). Parameter names and shapes are those of
    ``px.models``' ``FeedForward`` (``fc`` ``[D, F]`` named ``("embed", "mlp")``, ``proj``
    ``[F, D]``), so the state of one loads into the other.

    Args:
      embed_dim: D, the input and output width.
      mlp_dim: F, the hidden width, split over the ranks (must divide by their number).
      rngs: the ``nnx.Rngs`` for the kernels.
      activation: applied elementwise on the hidden slice (no communication needed).
      axis: the tensor-parallel mesh axis.
      sequence_parallel: input and output are split along the sequence (dimension 1).
      kernel_init: init of ``fc``; out_init: init of ``proj``.
      dtype: compute dtype; param_dtype: storage dtype.

    Example:
      >>> import jax.numpy as jnp, parallax.nn
      >>> from flax import nnx
      >>> parallax.nn.ParallelMLP(8, 32, rngs=nnx.Rngs(0))(jnp.ones((1, 5, 8))).shape
      (1, 5, 8)

    References:
      Shoeybi et al., "Megatron-LM", 2019, figure 3a.
    """

    def __init__(self, embed_dim: int, mlp_dim: int, *, rngs: nnx.Rngs,
                 activation: Callable = jax.nn.gelu, axis: str = "tensor",
                 sequence_parallel: bool = False,
                 kernel_init: Initializer = nnx.initializers.normal(0.02),
                 out_init: Initializer = nnx.initializers.normal(0.02),
                 dtype=None, param_dtype=jnp.float32):
        kw = dict(rngs=rngs, axis=axis, sequence_parallel=sequence_parallel, dtype=dtype,
                  param_dtype=param_dtype)
        self.fc = ColumnParallelLinear(embed_dim, mlp_dim, names=("embed", "mlp"),
                                       kernel_init=kernel_init, **kw)
        self.proj = RowParallelLinear(mlp_dim, embed_dim, names=("mlp", "embed"),
                                      kernel_init=out_init, **kw)
        self.activation = activation

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.activation(self.fc(x))
        if not regions.is_manual(self.fc.axis) and h.ndim == 3:
            h = constrain(h, ("batch", None, "mlp"))  # GSPMD: keep the hidden split
        return self.proj(h)
