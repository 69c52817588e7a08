"""px.Float8's pieces: scales against written-out references, the float8 matmul against
its definition, the layers it switches, and its pinned errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import parallax as px
from parallax.strategies.float8 import scaling
from parallax.strategies.float8.matmul import float8_dot_general
from parallax.strategies.float8.modules import Float8Modules, dense_kernels
from parallax.strategies.float8.recipe import Float8Recipe

LINEAR = (((1,), (0,)), ((), ()))


def test_current_scale_is_fp8_max_over_amax_and_power_of_2_rounds_down():
    x = jnp.array([[0.5, -3.0], [2.0, 1.0]])
    amax = scaling.amax(x, (0, 1))
    assert amax.shape == (1, 1) and float(amax[0, 0]) == 3.0
    assert float(scaling.scale_from_amax(amax, jnp.float8_e4m3fn)[0, 0]) == pytest.approx(448 / 3)
    assert float(scaling.scale_from_amax(amax, jnp.float8_e5m2)[0, 0]) == pytest.approx(57344 / 3)
    # 149.33 rounds down to 128 (torchao's round_scales_to_power_of_2).
    assert float(scaling.scale_from_amax(amax, jnp.float8_e4m3fn, True)[0, 0]) == 128.0
    # An all-zero tensor: amax clamped at 1e-12, a finite scale.
    assert np.isfinite(float(scaling.scale_from_amax(jnp.float32(0.0), jnp.float8_e4m3fn)))
    rows = scaling.amax(x, (1,))
    np.testing.assert_array_equal(rows[:, 0], [3.0, 2.0])


def test_quantize_saturates_instead_of_overflowing():
    q = scaling.quantize(jnp.array([1e6, -1e6, 1.0]), jnp.float32(1.0), jnp.float8_e4m3fn)
    np.testing.assert_array_equal(q.astype(jnp.float32), [448.0, -448.0, 1.0])


def _delayed_reference(history, scale, fp8_max, algo, margin):
    """Transformer Engine's amax_and_scale_update, written out element by element."""
    length = len(history)
    amax = history[0] if algo == "most_recent" else max(history)
    new_scale = fp8_max * 2.0 ** -margin / amax if (amax > 0 and np.isfinite(amax)) else scale
    # Slot i takes slot i+1's amax, the last slot this step's (slot 0), slot 0 is zeroed.
    rolled = [0.0] + [history[i + 1] for i in range(1, length - 1)] + [history[0]]
    return (rolled if length > 1 else [0.0]), new_scale


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0.0, 1.0])
def test_delayed_scaling_update_matches_the_written_out_recipe(algo, margin):
    history, scale = [3.0, 0.5, 7.0, 2.0], 1.5
    for step_amax in [4.0, 0.0, 9.0, float("inf")]:
        h = scaling.record_amax(jnp.array(history, jnp.float32), jnp.float32(step_amax))
        expected_h, expected_s = _delayed_reference(
            [max(history[0], step_amax)] + history[1:], scale, 448.0, algo, margin)
        got_h, got_s = scaling.amax_and_scale_update(h, jnp.float32(scale), jnp.float8_e4m3fn,
                                                     algo=algo, margin=margin)
        np.testing.assert_allclose(np.asarray(got_h), expected_h)
        assert float(got_s) == pytest.approx(expected_s)
        history, scale = list(np.asarray(got_h)), float(got_s)


def _reference_matmul(x, w, scaling_name):
    """The forward written out in numpy: cast each operand with its own scale, multiply,
    divide by the scales."""
    x, w = np.asarray(x, np.float32), np.asarray(w, np.float32)
    if scaling_name == "tensorwise":
        sx, sw = 448 / np.abs(x).max(), 448 / np.abs(w).max()
    else:
        sx = 2.0 ** np.floor(np.log2(448 / np.abs(x).max(axis=1, keepdims=True)))
        sw = 2.0 ** np.floor(np.log2(448 / np.abs(w).max(axis=0, keepdims=True)))
    xq = np.asarray(jnp.asarray(np.clip(x * sx, -448, 448)).astype(jnp.float8_e4m3fn), np.float32)
    wq = np.asarray(jnp.asarray(np.clip(w * sw, -448, 448)).astype(jnp.float8_e4m3fn), np.float32)
    return (xq @ wq) / sx / sw


@pytest.mark.parametrize("scaling_name", ["tensorwise", "rowwise"])
def test_forward_equals_the_written_out_scaled_matmul_and_gradients_are_close(scaling_name):
    kx, kw = jax.random.split(jax.random.key(0))
    x, w = jax.random.normal(kx, (8, 32)), 0.1 * jax.random.normal(kw, (32, 16))
    dot = float8_dot_general(Float8Recipe(scaling=scaling_name))
    np.testing.assert_allclose(dot(x, w, LINEAR), _reference_matmul(x, w, scaling_name),
                               rtol=1e-5, atol=1e-6)
    loss = lambda d: lambda x, w: jnp.sum(jnp.tanh(d(x, w, LINEAR)))
    got = jax.grad(loss(dot), (0, 1))(x, w)
    exact = jax.grad(loss(jax.lax.dot_general), (0, 1))(x, w)
    for g, e in zip(got, exact):
        # e5m2 keeps 2 mantissa bits (12.5% spacing): about 5% relative in norm.
        assert float(jnp.linalg.norm(g - e) / jnp.linalg.norm(e)) < 0.1


def test_lowered_program_has_float8_dots_and_cpu_compiles_them_through_converts():
    dot = float8_dot_general(Float8Recipe())
    f = jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(jnp.tanh(dot(x, w, LINEAR))), (0, 1)))
    kx, kw = jax.random.split(jax.random.key(1))
    lowered = f.lower(jax.random.normal(kx, (8, 32)), jax.random.normal(kw, (32, 16)))
    text = lowered.as_text()
    assert text.count("tensor<8x32xf8E4M3FN>, tensor<32x16xf8E4M3FN>) -> tensor<8x16xf32>") == 1
    assert "xf8E5M2>" in text  # both gradient matmuls take the e5m2 gradient
    # XLA's CPU backend (jax 0.10.2 and 0.12.1 alike) widens float8 dot operands back to
    # float32 before its dot: the values went through float8, the multiply does not.
    compiled = lowered.compile().as_text()
    assert "f8e4m3fn" in compiled and "f8e5m2" in compiled


def test_other_dot_layouts_run_unchanged():
    dot = float8_dot_general(Float8Recipe())
    x, w = jnp.ones((2, 4, 8)), jnp.ones((2, 8, 3))
    batched = (((2,), (1,)), ((0,), (0,)))
    np.testing.assert_array_equal(dot(x, w, batched), jax.lax.dot_general(x, w, batched))


class _Net(nnx.Module):
    def __init__(self, rngs):
        self.body = nnx.Linear(16, 32, rngs=rngs)
        self.head = nnx.Linear(32, 16, rngs=rngs)


def test_hook_switches_linear_and_dense_layers_and_skips_by_path():
    net = _Net(nnx.Rngs(0))
    recipe = Float8Recipe(skip=("head",))
    Float8Modules(recipe)(net)
    assert net.body.dot_general is not jax.lax.dot_general
    assert net.head.dot_general is jax.lax.dot_general
    gpt = px.models.GPT(px.models.GPTConfig.tiny(), rngs=nnx.Rngs(0))
    kernels = dense_kernels(gpt, Float8Recipe())
    assert kernels and all(stacked == 1 for stacked in kernels.values())  # stacked blocks


def test_compose_keeps_one_recipe():
    s = px.compose(px.DataParallel("data"), px.Float8(), px.MixedPrecision())
    assert s.float8.recipe.scaling == "tensorwise" and s.precision.compute == "bfloat16"
    with pytest.raises(ValueError, match=r"px.compose: two different float8 recipes .*keep "
                                         r"one px.Float8"):
        px.compose(px.Float8(), px.Float8("rowwise"))


@pytest.mark.parametrize("kwargs, error, message", [
    ({"scaling": "blockwise"}, ValueError,
     r"px.Float8: scaling='blockwise' is not one of \('tensorwise', 'rowwise'\)"),
    ({"scaling": "rowwise", "fsdp_float8_gather": True}, ValueError,
     r"px.Float8: fsdp_float8_gather=True needs scaling='tensorwise'.*Set "
     r"fsdp_float8_gather=False"),
    ({"delayed": True, "scaling": "rowwise"}, ValueError,
     r"px.Float8: delayed scaling keeps one amax history per tensor, so it is tensorwise only"),
    ({"skip": "head"}, TypeError, r"px.Float8: skip='head' must be a tuple of module-path"),
    ({"amax_compute_algo": "mean"}, ValueError,
     r"px.Float8: amax_compute_algo='mean' is not one of \('max', 'most_recent'\)"),
])
def test_bad_settings_are_refused_with_a_fix(kwargs, error, message):
    with pytest.raises(error, match=message):
        px.Float8(**kwargs)
