"""A multi-layer perceptron whose kernels alternate Megatron's column/row naming.

Layer ``i`` maps ``sizes[i] -> sizes[i+1]`` with kernel names ``("embed", "mlp")`` for even
``i`` (column parallel under tensor parallelism: the output is split) and ``("mlp", "embed")``
for odd ``i`` (row parallel: the input is split, the output is summed). Two consecutive
layers therefore need one all-reduce between them and none inside, as in Megatron's MLP.

References:
  Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models Using
  Model Parallelism", 2019, section 3 (the MLP split).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from parallax.nn.layers import Dense
from parallax.activations import constrain


def _layer_names(i: int) -> tuple[str, str]:
    return ("embed", "mlp") if i % 2 == 0 else ("mlp", "embed")


class MLP(nnx.Module):
    """A stack of dense layers with an activation between them, annotated for sharding.

    Args:
      in_features: size of the input's last dimension.
      hidden: sizes of the hidden layers (may be empty: one linear layer).
      out_features: size of the output's last dimension.
      rngs: the ``nnx.Rngs`` to initialise the kernels from.
      activation: applied after every layer but the last (GELU by default).
      dtype: compute dtype; None keeps the input's.
      param_dtype: storage dtype of the params.

    Returns:
      Calling the module on ``x`` of shape ``[B, in_features]`` gives ``[B, out_features]``.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from parallax.models import MLP
      >>> model = MLP(4, [16, 16], 2, rngs=nnx.Rngs(0))
      >>> model(jnp.ones((8, 4))).shape
      (8, 2)

    References:
      Megatron-LM (Shoeybi et al., 2019): column- then row-parallel linear layers.
    """

    def __init__(
        self,
        in_features: int,
        hidden: Sequence[int],
        out_features: int,
        *,
        rngs: nnx.Rngs,
        activation: Callable[[jax.Array], jax.Array] = jax.nn.gelu,
        dtype: jnp.dtype | None = None,
        param_dtype: jnp.dtype = jnp.float32,
    ):
        sizes = [in_features, *hidden, out_features]
        for name, size in (("in_features", in_features), ("out_features", out_features)):
            if size <= 0:
                raise ValueError(f"MLP: {name} must be positive, got {size}.")
        if any(h <= 0 for h in hidden):
            raise ValueError(f"MLP: every hidden size must be positive, got {list(hidden)}.")
        self.layers = nnx.List(
            [
                Dense(
                    (sizes[i],),
                    (sizes[i + 1],),
                    _layer_names(i),
                    rngs=rngs,
                    kernel_init=nnx.initializers.lecun_normal(),
                    dtype=dtype,
                    param_dtype=param_dtype,
                )
                for i in range(len(sizes) - 1)
            ]
        )
        self.activation = activation

    def __call__(self, x: jax.Array) -> jax.Array:
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < last:
                # The hidden activation carries the kernel's output name: split over the
                # tensor axis after a column layer, whole after a row layer.
                x = constrain(self.activation(x), ("batch", _layer_names(i)[1]))
        return x


def mse_loss(model: Callable[[jax.Array], jax.Array], batch: Mapping[str, jax.Array]) -> jax.Array:
    """Mean squared error of ``model(batch["x"])`` against ``batch["y"]``, in float32.

    Every example weighs the same (a plain mean over the batch of each example's mean over
    output features), so the mean of per-shard losses is the full-batch loss: what data
    parallelism relies on.

    Args:
      model: a callable mapping ``[B, in]`` to ``[B, out]``, e.g. an ``MLP``.
      batch: ``{"x": [B, in], "y": [B, out]}``.

    Returns:
      A float32 scalar.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from parallax.models import MLP, mse_loss
      >>> model = MLP(4, [8], 2, rngs=nnx.Rngs(0))
      >>> loss = mse_loss(model, {"x": jnp.ones((8, 4)), "y": jnp.zeros((8, 2))})
      >>> loss.shape, loss.dtype
      ((), dtype('float32'))
    """
    pred = jnp.asarray(model(batch["x"]), jnp.float32)
    y = jnp.asarray(batch["y"], jnp.float32)
    if pred.shape != y.shape:
        raise ValueError(
            f"mse_loss: the model's output has shape {pred.shape} but batch['y'] has shape "
            f"{y.shape}; they must match (is out_features right?)."
        )
    return jnp.mean(jnp.square(pred - y))
