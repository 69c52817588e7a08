"""px.models.Llama: shapes, RoPE, GQA, names, sizes, errors, equivalence under 3D parallelism."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import parallax as px
from parallax.models import (
    Llama,
    LlamaConfig,
    RopeScaling,
    llama_flops_per_token,
    llama_param_count,
    llama_stages,
    next_token_loss,
)
from parallax.models.llama import TENSOR_PLAN, token_positions
from parallax.planner.predicted.compute import loss_flops_per_token
from parallax.attention import dot_product_attention
from parallax.nn.llama_layers import GroupedQueryAttention, SwiGLU
from parallax.nn.rope import apply_rotary, rope_frequencies
from parallax.rules import annotated_leaves

TINY = LlamaConfig.tiny()
TX = optax.sgd(0.1, momentum=0.9)  # as the GPT's tests: Adam would test rounding, not strategy
STEPS = 3


def _tokens(shape, seed=1):
    return jax.random.randint(jax.random.key(seed), shape, 0, TINY.vocab_size, jnp.int32)


def _size(model):
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def _abstract(config):
    return nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))


@pytest.fixture(scope="module")
def model():
    return Llama(TINY, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def forward(model):
    graphdef, state = nnx.split(model)
    fn = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens))
    return lambda tokens: fn(state, tokens)


@pytest.mark.slow
def test_shapes_causality_and_the_loss(model, forward):
    tokens = _tokens((2, 32))
    logits = forward(tokens)
    assert logits.shape == (2, 32, TINY.vocab_size) and logits.dtype == jnp.float32
    changed = tokens.at[:, 20].set((tokens[:, 20] + 1) % TINY.vocab_size)
    after = forward(changed)
    np.testing.assert_allclose(logits[:, :20], after[:, :20], atol=1e-6)
    assert not np.allclose(logits[:, 20:], after[:, 20:], atol=1e-4)
    batch = {"tokens": _tokens((2, 17))}
    loss = next_token_loss(model, batch)
    assert abs(float(loss) - math.log(TINY.vocab_size)) < 0.1  # near uniform at init
    np.testing.assert_allclose(llama_stages(model, batch), loss, rtol=1e-6)


def test_rope_is_the_rotation_of_each_pair():
    # Reference: dimensions (i, i + K/2) are a complex number rotated by position * f_i.
    k, t = 8, 5
    x = np.asarray(jax.random.normal(jax.random.key(0), (1, t, 2, k)))
    freqs = rope_frequencies(k, theta=100.0)
    np.testing.assert_allclose(freqs, 100.0 ** (-np.arange(0, k, 2) / k), rtol=1e-6)
    z = x[..., : k // 2] + 1j * x[..., k // 2:]
    z = z * np.exp(1j * np.arange(t)[None, :, None, None] * freqs[None, None, None, :])
    expected = np.concatenate([z.real, z.imag], axis=-1)
    np.testing.assert_allclose(apply_rotary(jnp.asarray(x), jnp.arange(t), freqs), expected,
                               atol=1e-6)


def test_llama3_scaling_of_the_frequencies():
    # Llama 3.1's rule, one frequency at a time: keep the fast ones, slow the slow ones by
    # ``factor``, interpolate in between (the Llama 3 paper; Hugging Face's _compute_llama3).
    s = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)
    plain = rope_frequencies(128, 500000.0)
    scaled = rope_frequencies(128, 500000.0, s)
    kinds = set()
    for f, g in zip(plain.astype(np.float64), scaled.astype(np.float64)):
        wavelength = 2 * math.pi / f
        if wavelength < 8192 / 4:
            want, kind = f, "kept"
        elif wavelength > 8192 / 1:
            want, kind = f / 8, "scaled"
        else:
            mix = (8192 / wavelength - 1) / (4 - 1)
            want, kind = (1 - mix) * f / 8 + mix * f, "smoothed"
        kinds.add(kind)
        assert g == pytest.approx(want, rel=1e-6)
    assert kinds == {"kept", "scaled", "smoothed"}


@pytest.mark.slow
def test_grouped_query_attention_equals_multi_head_with_repeated_heads():
    d, h, g = 32, 4, 2
    freqs = rope_frequencies(d // h)
    gqa = GroupedQueryAttention(d, h, g, freqs, rngs=nnx.Rngs(0))
    mha = GroupedQueryAttention(d, h, h, freqs, rngs=nnx.Rngs(1))
    mha.query.kernel[...] = gqa.query.kernel[...]
    mha.out.kernel[...] = gqa.out.kernel[...]
    # query head i reads key/value head i // (h / g); the kernel is [D, 2 (k, v), G, K]
    mha.key_value.kernel[...] = jnp.repeat(gqa.key_value.kernel[...], h // g, axis=2)
    x = jax.random.normal(jax.random.key(2), (2, 6, d))
    np.testing.assert_allclose(gqa(x, token_positions(6)), mha(x, token_positions(6)),
                               atol=1e-6)


def test_fused_projections_equal_separate_matmuls_with_two_fewer():
    # k with v and gate with up are one matmul each: the same numbers as five separate
    # projections (the layout before fusing), two dot ops fewer in the lowered program.
    d, h, g, f = 32, 4, 2, 64
    attn = GroupedQueryAttention(d, h, g, rope_frequencies(d // h), rngs=nnx.Rngs(0))
    mlp = SwiGLU(d, f, rngs=nnx.Rngs(1))
    x, positions = jax.random.normal(jax.random.key(2), (2, 6, d)), token_positions(6)
    inv_freq = np.asarray(attn.inv_freq, np.float32)
    params = {"q": attn.query.kernel[...], "kv": attn.key_value.kernel[...],
              "out": attn.out.kernel[...], "gate_up": mlp.gate_up.kernel[...],
              "down": mlp.down.kernel[...]}

    def separate(p, x):
        project = lambda w: jnp.einsum("btd,d...->bt...", x, w)  # noqa: E731
        q = apply_rotary(project(p["q"]), positions, inv_freq)
        k = apply_rotary(project(p["kv"][:, 0]), positions, inv_freq)
        y = dot_product_attention(q, k, project(p["kv"][:, 1]), causal=True)
        a = jnp.einsum("bthk,hkd->btd", y, p["out"])
        gate, up = a @ p["gate_up"][:, 0], a @ p["gate_up"][:, 1]
        return (jax.nn.silu(gate) * up) @ p["down"]

    graphdefs, states = zip(*(nnx.split(m) for m in (attn, mlp)))

    def fused(p, x):
        del p  # the modules' own parameters (the same arrays)
        a, m = (nnx.merge(gd, st) for gd, st in zip(graphdefs, states))
        return m(a(x, positions))

    np.testing.assert_allclose(fused(params, x), separate(params, x), rtol=1e-5, atol=1e-6)
    dots = [jax.jit(fn).lower(params, x).as_text().count("dot_general")
            for fn in (fused, separate)]
    assert dots[0] == dots[1] - 2


def test_names_follow_the_tensor_plan(model):
    leaves = {jax.tree_util.keystr(a.path[:-1], simple=True, separator="."): (a.leaf.shape, a.names)
              for a in annotated_leaves(nnx.state(model, nnx.Param))}
    L, D, H, G, K, F, V = 2, 64, 4, 2, 16, 128, 256
    assert leaves["embed"] == ((V, D), ("vocab", "embed"))
    assert leaves["head"] == ((D, V), ("embed", "vocab"))
    assert leaves["blocks.attn.query.kernel"] == ((L, D, H, K), ("layers", "embed", "heads", "kv"))
    assert leaves["blocks.attn.key_value.kernel"] == ((L, D, 2, G, K),
                                                      ("layers", "embed", None, "kv_heads", "kv"))
    assert leaves["blocks.mlp.gate_up.kernel"] == ((L, D, 2, F), ("layers", "embed", None, "mlp"))
    assert leaves["blocks.mlp.down.kernel"] == ((L, F, D), ("layers", "mlp", "embed"))
    split = {"heads", "kv_heads", "mlp", "vocab"}
    for path, (shape, names) in leaves.items():
        style = next((s for p, s in TENSOR_PLAN.items() if re.fullmatch(
            p.replace(".", r"\.").replace("*", ".*"), path.rsplit(".", 1)[0] if "." in path
            else path)), None)
        assert style is not None, path
        parts = [n for n in names if n in split]
        if style == "sequence":
            assert parts == [], path
        elif style == "vocab":
            assert parts == ["vocab"], path
        elif style == "colwise":  # the output dimensions (after "embed") are split
            assert parts and names.index(parts[0]) > names.index("embed"), path
        else:  # rowwise: the contracted ones
            assert parts and names.index(parts[0]) < names.index("embed"), path
    assert not any(hasattr(m, "bias") and m.bias is not None
                   for _, m in nnx.iter_modules(model))  # no biases


@pytest.mark.parametrize("config, expected", [
    (LlamaConfig.llama2_7b(), 6_738_415_616),
    (LlamaConfig.llama3_8b(), 8_030_261_248),
    (LlamaConfig.llama3_1b(), 1_235_814_400),
    (TINY, 106_816),
    (LlamaConfig.tiny(tie_embeddings=True, vocab_size=250, vocab_pad_multiple=64), None),
])
def test_param_count_is_the_real_count(config, expected):
    # The published sizes (Hugging Face's model cards), and the built model's.
    assert llama_param_count(config) == _size(_abstract(config))
    if expected is not None:
        assert llama_param_count(config) == expected


def test_flops_per_token():
    c = TINY
    n = llama_param_count(c) - c.padded_vocab_size * c.embed_dim  # the lookup is no matmul
    assert llama_flops_per_token(c, 32) == 6 * n + 12 * c.num_layers * 32 * c.embed_dim


@pytest.mark.slow
def test_vocabulary_padding_keeps_the_loss():
    padded = LlamaConfig.tiny(vocab_size=250, vocab_pad_multiple=64)
    plain = LlamaConfig.tiny(vocab_size=250)
    batch = {"tokens": _tokens((2, 9)) % 250}
    a, b = Llama(padded, rngs=nnx.Rngs(0)), Llama(plain, rngs=nnx.Rngs(0))
    assert a.embed.shape == (256, 64)
    np.testing.assert_allclose(next_token_loss(a, batch), next_token_loss(b, batch), rtol=1e-6)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(num_kv_heads=3), ValueError,
     "LlamaConfig: num_heads=4 is not a multiple of num_kv_heads=3"),
    (dict(embed_dim=60), ValueError, "LlamaConfig: embed_dim=60 must be num_heads=4 times an "
                                     "even head size"),
    (dict(mlp_dim=0), ValueError, "LlamaConfig: mlp_dim must be a positive int, got 0"),
    (dict(rope_scaling={"factor": 8}), TypeError, "LlamaConfig: rope_scaling must be a "
                                                  "RopeScaling or None"),
])
def test_bad_configs(kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        LlamaConfig.tiny(**kwargs)


def test_bad_inputs(model):
    with pytest.raises(TypeError, match=re.escape("Llama: config must be a LlamaConfig, got "
                                                  "GPTConfig")):
        Llama(px.models.GPTConfig.tiny(), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=re.escape("Llama.embed: sequence length 65 exceeds "
                                                   "max_seq_len=64")):
        model(jnp.zeros((1, 65), jnp.int32))
    with pytest.raises(ValueError, match=re.escape("Llama.embed: token id 300 at tokens[0, 1]")):
        model(jnp.array([[1, 300]], jnp.int32))


# Equivalence with one device: the whole training state after every step.

def _state():
    return px.TrainState.create(Llama(TINY, rngs=nnx.Rngs(0)), TX)


def _batches(rows=8, seq=16):
    return [{"tokens": _tokens((rows, seq + 1), seed=10 + i)} for i in range(STEPS)]


def _run(mesh, strategy, loss_fn, batches):
    """Host copies of (loss, state) after each step: one device (jit) or px.train_step."""
    if mesh is None:
        state = _state()

        @jax.jit
        def step(state, batch):
            loss, grads = jax.value_and_grad(
                lambda p: next_token_loss(nnx.merge(state.graphdef, p, state.rest), batch)
            )(state.params)
            return state.apply_gradients(grads), loss
    else:
        state = px.init(_state, mesh, strategy)

        @px.train_step(mesh, strategy)
        def step(state, batch):
            loss, grads = px.value_and_grad(loss_fn)(state.model, batch)
            return state.apply_gradients(grads), loss

    out = []
    for batch in batches:
        state, loss = step(state, batch)
        out.append((float(loss), jax.device_get((state.params, state.opt_state))))
    return out


@pytest.fixture(scope="module")
def reference():
    return _run(None, None, None, _batches())


def _assert_same_every_step(run, reference):
    for i, ((loss, state), (ref_loss, ref_state)) in enumerate(zip(run, reference)):
        assert loss == pytest.approx(ref_loss, rel=1e-5), i
        assert px.testing.relative_difference(state, ref_state) <= 1e-5, i


@pytest.mark.slow
def test_dp_fsdp_tp_trains_like_one_device(reference):
    mesh = px.make_mesh(data=2, fsdp=2, tensor=2)
    strategy = px.compose(px.DataParallel("data"), px.FSDP("fsdp"), px.TensorParallel("tensor"))
    _assert_same_every_step(_run(mesh, strategy, next_token_loss, _batches()), reference)


@pytest.mark.slow
def test_tensor_and_sequence_parallel_train_like_one_device(reference):
    # 4 ranks: the 2 key/value heads are replicated, the 4 query heads split.
    mesh = px.make_mesh(data=2, tensor=4)
    strategy = px.compose(px.DataParallel("data", style="gspmd"),
                          px.TensorParallel("tensor", sequence_parallel=True))
    _assert_same_every_step(_run(mesh, strategy, next_token_loss, _batches()), reference)


@pytest.mark.slow
def test_pipeline_trains_like_one_device(reference):
    mesh = px.make_mesh(data=2, stage=2, devices=jax.devices()[:4])
    strategy = px.compose(px.DataParallel("data"), px.Pipeline("stage", microbatches=2))
    _assert_same_every_step(_run(mesh, strategy, llama_stages, _batches()), reference)


@pytest.mark.slow
def test_explain_knows_the_llama():
    mesh, strategy = px.make_mesh(data=2, tensor=4), px.compose(
        px.DataParallel("data"), px.TensorParallel("tensor"))

    @px.train_step(mesh, strategy)
    def step(state, batch):
        loss, grads = px.value_and_grad(next_token_loss)(state.model, batch)
        return state.apply_gradients(grads), {"loss": loss}

    state = jax.eval_shape(_state)
    batch = {"tokens": jax.ShapeDtypeStruct((8, 33), jnp.int32)}
    report = px.explain(step, state, batch)
    params = report.row("parameters")
    assert params.predicted == params.measured
    flops = report.row("matmul flops")
    # the model's flops, plus the chunked loss's logits formed again in its backward
    per_token = llama_flops_per_token(TINY, 32) + loss_flops_per_token(TINY, 32)
    assert flops.predicted == per_token * 8 * 32 / 8
    assert flops.measured == pytest.approx(flops.predicted, rel=0.2)
