"""ZeRO 3 / FSDP with float8 weights: each shard cast to e4m3 before the all-gather.

torchao's trick (``enable_fsdp_float8_all_gather``): the dense layers' weights are about
to be cast to float8 for their matmul anyway, so the cast moves before the all-gather
and the gather moves a quarter of float32's bytes (half of bfloat16's). The shards agree
on one scale per weight (per layer for stacked layers) through one max all-reduce of a
scalar amax (torchao's ``precompute_float8_dynamic_scale_for_fsdp`` does the same
reduction for all weights at once). The gathered weight is dequantized to its dtype:
the matmul's tensorwise cast then finds the same amax and scale, so it gets back the
float8 values that travelled.

:class:`Float8Matmuls` is what ``px.Float8`` puts in ``Strategy.float8``
(:class:`parallax.strategy_hooks.Float8Weights`): ``px.value_and_grad``'s explicit style
asks it which kernels to gather this way and calls :meth:`Float8Matmuls.gather`.

References:
  torchao ``torchao/float8/fsdp_utils.py`` (``WeightWithDynamicFloat8CastTensor``:
  ``fsdp_pre_all_gather`` casts the shard, ``fsdp_post_all_gather`` wraps the gathered
  float8 data with its scale); torchtitan ``docs/float8.md``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

from parallax.strategies.float8 import scaling
from parallax.strategies.float8.modules import dense_kernels
from parallax.strategies.float8.recipe import Float8Recipe


@dataclasses.dataclass(frozen=True)
class Float8Matmuls:
    """The float8 recipe as the core sees it: which kernels ZeRO 3 gathers in float8, and
    how.

    Attributes:
      recipe: the :class:`Float8Recipe`.
    """

    recipe: Float8Recipe

    def gathered_kernels(self, model) -> dict[str, int]:
        """``{kernel path: leading stacked dims}`` to gather in float8 (none unless the
        recipe asks for it)."""
        if not self.recipe.fsdp_float8_gather or model is None:
            return {}
        return dense_kernels(model, self.recipe)

    def gather(self, shard: jax.Array, gather: Callable, axis: str, stacked: int) -> jax.Array:
        """The full weight from ``shard`` (inside ``shard_map`` over ``axis``), travelling
        in e4m3 with one scale per stacked layer."""
        dims = tuple(range(stacked, shard.ndim))
        scale = scaling.scale_from_amax(scaling.amax(shard, dims, (axis,)), scaling.FORWARD,
                                        self.recipe.power_of_2_scales)
        full = gather(scaling.quantize(shard, scale, scaling.FORWARD))
        return scaling.dequantize(full, scale, shard.dtype)
