"""The planner prices a px.Float8 step's matmuls at the chip's float8 peak: half the bf16
step's matmul time on an H100 (1,979 vs 989 TFLOP/s dense), the same on an A100 (no
float8 units: bf16's peak); the memory-bound part and the communication do not change."""

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, AxisType

import parallax as px
from parallax.planner.predicted.step_time import estimate
from parallax.planner.setting import read_setting
from parallax.planner.topology import cluster


def _split(strategy, chip_cluster):
    config = px.models.GPTConfig.gpt2_350m(dtype=jnp.bfloat16)
    state = jax.eval_shape(lambda: px.TrainState.create(
        px.models.GPT(config, rngs=nnx.Rngs(0)), optax.adamw(1e-4)))
    mesh = AbstractMesh((16,), ("data",), (AxisType.Auto,))
    setting = read_setting(mesh, strategy, state,
                           {"tokens": jax.ShapeDtypeStruct((64, 1025), jnp.int32)},
                           backend="gpu")
    return estimate(setting, cluster(chip_cluster))


@pytest.mark.parametrize("chip_cluster, ratio", [("dgx-h100", 0.5), ("dgx-a100", 1.0)])
def test_float8_matmuls_are_priced_at_the_chips_float8_peak(chip_cluster, ratio):
    bf16 = _split(px.DataParallel("data"), chip_cluster)
    fp8 = _split(px.compose(px.DataParallel("data"), px.Float8()), chip_cluster)
    assert fp8.matmul / bf16.matmul == pytest.approx(ratio, rel=1e-3)
    assert fp8.peak_flops / bf16.peak_flops == pytest.approx(1 / ratio, rel=1e-3)
    assert fp8.memory_bound == bf16.memory_bound
    assert fp8.communication == bf16.communication
    assert fp8.model_flops == bf16.model_flops
