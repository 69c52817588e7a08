"""The attention kernel per backend: the pure choice (called with "gpu" and "tpu" here), the
knob, what px.explain and the metrics table show, and the Pallas kernel (interpreted on
CPU) against XLA's over training steps, alone and under data x tensor parallelism."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import parallax as px
from parallax.attention import dot_product_attention
from parallax.attention_kernel import choose_kernel
from parallax.testing import relative_difference

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32


def kernel(platform, dtype, head_dim=64, length=2048, **kw):
    return choose_kernel(platform, dtype, head_dim=head_dim, query_len=length,
                         key_len=length, **kw)


@pytest.mark.parametrize("platform, dtype, head_dim, length, kw, expected", [
    ("gpu", BF16, 64, 2048, {}, "cudnn"),
    ("gpu", F16, 128, 1024, {"compute_capability": "8.0"}, "cudnn"),
    ("gpu", BF16, 256, 2048, {"compute_capability": "9.0"}, "cudnn"),   # Hopper: up to 256
    ("gpu", BF16, 256, 2048, {"compute_capability": "8.6"}, "xla"),     # Ampere: up to 128
    ("gpu", BF16, 60, 2048, {}, "xla"),                                 # not a multiple of 8
    ("gpu", BF16, 64, 2048, {"compute_capability": "7.5"}, "xla"),      # before Ampere
    ("gpu", F32, 64, 2048, {}, "xla"),                                  # cuDNN: 16-bit only
    ("rocm", BF16, 64, 2048, {}, "xla"),
    ("tpu", BF16, 64, 2048, {"pallas": True}, "pallas"),
    ("tpu", F32, 128, 512, {"pallas": True}, "pallas"),
    ("tpu", BF16, 64, 2000, {"pallas": True}, "xla"),                   # blocks of 128
    ("tpu", BF16, 64, 2048, {"pallas": False}, "xla"),                  # jax without it
    ("cpu", BF16, 64, 2048, {}, "xla"),
])
def test_auto_takes_the_fastest_kernel_that_fits(platform, dtype, head_dim, length, kw,
                                                 expected):
    choice = kernel(platform, dtype, head_dim, length, **kw)
    assert choice.kernel == expected, choice
    assert choice.reason


def test_the_reason_names_the_rule_a_slower_choice_comes_from():
    assert kernel("gpu", F32).reason == ("cuDNN does not fit: float32 inputs (it takes "
                                         "bfloat16 or float16)")
    assert "sequence lengths 2000, 2000 (it takes multiples of 128)" in kernel(
        "tpu", BF16, length=2000, pallas=True).reason


def test_the_explicit_styles_shard_map_keeps_pallas_out():
    # Its shard_map checks varying axes; a Pallas call's outputs carry none.
    choice = kernel("tpu", BF16, pallas=True, manual_axes=frozenset({"data"}))
    assert choice.kernel == "xla" and "use style='gspmd'" in choice.reason
    with pytest.raises(ValueError, match=r"cannot run here: a manual mesh axis \(data\)"):
        kernel("cpu", F32, requested="pallas", manual_axes=frozenset({"data"}))


def test_packed_documents_run_in_xla_which_takes_their_mask():
    # segment_ids reach only XLA's kernel so far: auto falls back, asking is refused.
    choice = kernel("gpu", BF16, masked=True)
    assert choice.kernel == "xla" and "packed documents (segment_ids)" in choice.reason
    assert kernel("tpu", BF16, masked=True).kernel == "xla"
    with pytest.raises(ValueError, match=r"'pallas' cannot run here: packed documents"):
        kernel("cpu", F32, requested="pallas", masked=True)
    q = jax.random.normal(jax.random.key(0), (1, 4, 2, 8))
    segments = jnp.array([[1, 1, 2, 2]])
    packed = dot_product_attention(q, q, q, segment_ids=segments)
    alone = jnp.concatenate([dot_product_attention(q[:, :2], q[:, :2], q[:, :2]),
                             dot_product_attention(q[:, 2:], q[:, 2:], q[:, 2:])], axis=1)
    np.testing.assert_allclose(packed, alone, rtol=1e-6, atol=1e-6)


def test_this_jax_ships_the_pallas_splash_kernel():
    # jax 0.10.2 and 0.12.1 both do: "auto" on a TPU is not a dead branch.
    assert kernel("tpu", BF16).kernel == "pallas"


def test_a_kernel_asked_for_that_cannot_run_is_a_clear_error():
    with pytest.raises(ValueError, match=r"px.train_step: attention kernel 'cudnn' cannot run "
                       r"here: the backend is cpu \(it runs on an NVIDIA GPU\)\. Use 'auto'"):
        kernel("cpu", BF16, requested="cudnn", api="px.train_step")
    with pytest.raises(ValueError, match=r"here: float32 inputs \(it takes bfloat16 or float16\)"):
        kernel("gpu", F32, requested="cudnn")
    assert kernel("gpu", F32, requested="xla").kernel == "xla"


def test_the_knob_refuses_a_name_that_is_no_kernel():
    mesh = px.make_mesh(data=1, devices=jax.devices()[:1])
    with pytest.raises(ValueError, match=r"px.train_step: attention='flash' is not an attention "
                       r"kernel; use one of \('auto', 'xla', 'cudnn', 'pallas'\)"):
        px.train_step(mesh, px.DataParallel("data"), attention="flash")
    q = jnp.ones((1, 8, 2, 16))
    with pytest.raises(ValueError, match="attention kernel 'cudnn' cannot run here"):
        dot_product_attention(q, q, q, kernel="cudnn")


def gpt_step(mesh, strategy, attention):
    @px.train_step(mesh, strategy, attention=attention)
    def step(state, batch):
        loss, grads = px.value_and_grad(px.models.next_token_loss)(state.model, batch)
        return state.apply_gradients(grads), {"loss": loss}
    return step


def test_explain_and_the_metrics_table_show_the_kernel():
    config = px.models.GPTConfig.tiny()
    mesh, strategy = px.make_mesh(data=2, devices=jax.devices()[:2]), px.DataParallel("data")
    state = jax.eval_shape(lambda: px.TrainState.create(px.models.GPT(config, rngs=nnx.Rngs(0)),
                                                        optax.sgd(0.1)))
    batch = {"tokens": jax.ShapeDtypeStruct((4, 17), jnp.int32)}
    assert px.explain(gpt_step(mesh, strategy, "auto"), state, batch).facts["attention"] == "xla"
    assert px.explain(gpt_step(mesh, strategy, "xla"), state, batch).facts["attention"] == (
        "xla (asked: xla)")
    step = gpt_step(mesh, strategy, "auto")
    meter = px.metrics.Throughput.for_step(step, state, batch, items_per_step=64)
    meter.step()
    row = [line.split() for line in meter.table().splitlines() if "attention" in line]
    assert row == [["attention", "kernel", "xla"]]


def llama_config():
    # T = 128: one block of the splash kernel; 4 query heads sharing 2 K/V heads.
    return px.models.LlamaConfig.tiny(max_seq_len=128)


def trajectory(mesh, strategy, attention, steps=2):
    config = llama_config()
    state = px.init(lambda: px.TrainState.create(px.models.Llama(config, rngs=nnx.Rngs(0)),
                                                 optax.sgd(0.5, momentum=0.9)), mesh,
                    strategy)
    step = gpt_step(mesh, strategy, attention)
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(steps):
        batch = {"tokens": rng.integers(0, config.vocab_size, (4, 129)).astype(np.int32)}
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, jax.device_get(state)


@pytest.mark.slow
@pytest.mark.parametrize("tensor", [2, 4])
def test_the_pallas_kernel_trains_as_xla_does(tensor):
    # GSPMD style (the Pallas kernel runs in its own shard_map over data and tensor).
    # tensor=2 splits the 4 query heads and the 2 K/V heads in 2 (each rank its own K/V
    # head); tensor=4: one query head per rank, the 2 K/V heads kept whole on every rank and
    # each rank slices its query head's K/V head.
    devices = 2 * tensor
    mesh = px.make_mesh(data=2, tensor=tensor, devices=jax.devices()[:devices])
    strategy = px.compose(px.DataParallel("data", style="gspmd"), px.TensorParallel("tensor"))
    want_losses, want = trajectory(mesh, strategy, "xla")
    losses, got = trajectory(mesh, strategy, "pallas")
    assert relative_difference(np.array(losses), np.array(want_losses)) < 1e-5
    assert relative_difference(got, want) < 1e-5
