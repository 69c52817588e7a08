"""px.models.GPT: shapes, causality, names, param counts, the scan, training, errors."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from parallax.analysis.executed import executed_cost
from parallax.models import (
    GPT,
    GPTConfig,
    block_forward,
    flops_per_token,
    next_token_loss,
    param_count,
)
from parallax.rules import annotated_leaves

TINY = GPTConfig.tiny()


@pytest.fixture(scope="module")
def model():
    return GPT(TINY, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def forward(model):
    graphdef, state = nnx.split(model)
    fn = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens))
    return lambda tokens: fn(state, tokens)


@pytest.fixture(scope="module")
def loss(model):
    graphdef, state = nnx.split(model)
    fn = jax.jit(lambda state, t: next_token_loss(nnx.merge(graphdef, state), {"tokens": t}))
    return lambda tokens: fn(state, tokens)


def _tokens(shape, seed=1):
    return jax.random.randint(jax.random.key(seed), shape, 0, TINY.vocab_size, jnp.int32)


def _abstract(config):
    return nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0)))


def _names(model):
    return {
        jax.tree_util.keystr(a.path[:-1], simple=True, separator="/"): (a.leaf.shape, a.names)
        for a in annotated_leaves(nnx.state(model, nnx.Param))
    }


def _size(model):
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def test_shapes_and_pieces(model, forward):
    tokens = _tokens((2, 16))
    logits = forward(tokens)
    assert logits.shape == (2, 16, TINY.vocab_size) and logits.dtype == jnp.float32
    graphdef, state = nnx.split(model)

    @jax.jit
    def pieces(state, tokens):
        m = nnx.merge(graphdef, state)
        x = m.embed(tokens)
        return x, m.unembed(m.apply_blocks(x))

    x, composed = pieces(state, tokens)
    assert x.shape == (2, 16, TINY.embed_dim)
    np.testing.assert_allclose(composed, logits, atol=1e-5)


def test_causal(forward):
    tokens = _tokens((2, 32))
    changed = tokens.at[:, 20].set((tokens[:, 20] + 1) % TINY.vocab_size)
    before, after = forward(tokens), forward(changed)
    np.testing.assert_allclose(before[:, :20], after[:, :20], atol=1e-6)
    assert not np.allclose(before[:, 20:], after[:, 20:], atol=1e-4)


def test_logical_names(model):
    L, D, H, K, F, V = 2, 64, 4, 16, 256, 256
    expected = {
        "wte": ((V, D), ("vocab", "embed")),
        "wpe": ((64, D), ("position", "embed")),
        "ln_f/scale": ((D,), ("embed",)),
        "ln_f/bias": ((D,), ("embed",)),
        "blocks/attn/out/kernel": ((L, H, K, D), ("layers", "heads", "kv", "embed")),
        "blocks/attn/out/bias": ((L, D), ("layers", "embed")),
        "blocks/mlp/fc/kernel": ((L, D, F), ("layers", "embed", "mlp")),
        "blocks/mlp/fc/bias": ((L, F), ("layers", "mlp")),
        "blocks/mlp/proj/kernel": ((L, F, D), ("layers", "mlp", "embed")),
        "blocks/mlp/proj/bias": ((L, D), ("layers", "embed")),
    }
    # q, k and v: one kernel, the stacked axis of 3 unnamed (never split)
    expected["blocks/attn/qkv/kernel"] = ((L, D, 3, H, K), ("layers", "embed", None, "heads", "kv"))
    for proj in ("query", "value"):  # no key bias: softmax cancels it
        expected[f"blocks/attn/{proj}_bias"] = ((L, H, K), ("layers", "heads", "kv"))
    for ln in ("ln1", "ln2"):
        for p in ("scale", "bias"):
            expected[f"blocks/{ln}/{p}"] = ((L, D), ("layers", "embed"))
    assert _names(model) == expected
    untied = _names(_abstract(GPTConfig.tiny(tie_embeddings=False)))
    assert untied["head"] == ((D, V), ("embed", "vocab"))


@pytest.mark.parametrize("config", [GPTConfig.tiny(), GPTConfig.gpt2_124m(num_layers=3)])
def test_every_param_has_names_of_its_rank(config):
    leaves = annotated_leaves(nnx.state(_abstract(config), nnx.Param))
    assert leaves
    for leaf in leaves:
        assert leaf.names is not None, leaf.path
        assert len(leaf.names) == len(leaf.leaf.shape), leaf.path


def test_builds_and_runs_with_no_mesh(model, forward):
    # ``model`` was built, and ``forward`` runs, with no mesh and flax's default eager
    # sharding on, which raises for an annotated param unless it opts out.
    assert jax.sharding.get_abstract_mesh().empty
    assert nnx.using_eager_sharding()
    assert forward(_tokens((1, 4))).shape == (1, 4, TINY.vocab_size)
    assert all(v.get_metadata()["eager_sharding"] is False
               for v in jax.tree.leaves(nnx.state(model, nnx.Param),
                                        is_leaf=lambda x: isinstance(x, nnx.Variable)))


def test_param_count_tied_and_untied(model):
    assert param_count(TINY) == _size(model) == 120_448
    untied = GPTConfig.tiny(tie_embeddings=False)
    assert param_count(untied) == _size(_abstract(untied)) == 120_448 + 64 * 256


@pytest.mark.parametrize(
    "config, expected",
    [
        (GPTConfig.small(), 3_289_600),
        (GPTConfig.gpt2_124m(), 124_466_688),
        (GPTConfig.gpt2_350m(), 354_846_720),
    ],
)
def test_param_count_of_presets(config, expected):
    assert param_count(config) == expected
    if config.num_layers <= 12:
        assert _size(_abstract(config)) == expected  # abstract: nothing allocated


def test_init_follows_gpt2(model):
    params = nnx.state(model, nnx.Param)
    std = lambda p: float(jnp.std(p[...]))  # noqa: E731
    assert std(params["wte"]) == pytest.approx(0.02, rel=0.05)
    assert std(params["blocks"]["attn"]["qkv"]["kernel"]) == pytest.approx(0.02, rel=0.05)
    scaled = 0.02 / math.sqrt(2 * TINY.num_layers)
    assert std(params["blocks"]["attn"]["out"]["kernel"]) == pytest.approx(scaled, rel=0.05)
    assert std(params["blocks"]["mlp"]["proj"]["kernel"]) == pytest.approx(scaled, rel=0.05)
    assert not jnp.any(params["blocks"]["mlp"]["fc"]["bias"][...])
    assert jnp.all(params["blocks"]["ln1"]["scale"][...] == 1)
    # Each layer draws its own kernels (the vmap split the rngs).
    qkv = params["blocks"]["attn"]["qkv"]["kernel"][...]
    assert not jnp.allclose(qkv[0], qkv[1])


def _dot_generals(num_layers):
    graphdef, state = nnx.split(_abstract(GPTConfig.tiny(num_layers=num_layers)))
    tokens = jax.ShapeDtypeStruct((2, 9), jnp.int32)
    grad = jax.grad(lambda s, t: next_token_loss(nnx.merge(graphdef, s), {"tokens": t}))
    return str(jax.make_jaxpr(grad)(state, tokens)).count("dot_general")


def test_scan_keeps_the_program_size_constant():
    assert _dot_generals(2) == _dot_generals(6) > 0


def test_block_forward_layer_by_layer_equals_apply_blocks(model):
    graphdef, stacked = nnx.split(model.blocks)
    x = model.embed(_tokens((2, 8)))

    @jax.jit
    def loop(stacked, x):
        for i in range(TINY.num_layers):
            x = block_forward(nnx.merge(graphdef, jax.tree.map(lambda a: a[i], stacked)), x)
        return x

    np.testing.assert_allclose(loop(stacked, x), model.apply_blocks(x), atol=1e-5)


def test_next_token_loss(loss, forward):
    tokens = _tokens((4, 17))
    value = loss(tokens)
    assert value.shape == () and value.dtype == jnp.float32
    assert value == pytest.approx(math.log(TINY.vocab_size), rel=0.05)  # near uniform at init
    logp = jax.nn.log_softmax(forward(tokens[:, :-1]))
    manual = -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))
    np.testing.assert_allclose(value, manual, rtol=1e-5)


def test_bf16_compute_gives_fp32_logits():
    graphdef, state = nnx.split(_abstract(GPTConfig.tiny(dtype=jnp.bfloat16)))
    tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
    logits = jax.eval_shape(lambda s, t: nnx.merge(graphdef, s)(t), state, tokens)
    assert logits.dtype == jnp.float32
    residual = jax.eval_shape(lambda s, t: nnx.merge(graphdef, s).embed(t), state, tokens)
    assert residual.dtype == jnp.bfloat16


@pytest.mark.slow
def test_adam_training_lowers_the_loss(model):
    graphdef, params = nnx.split(model, nnx.Param)
    batch = {"tokens": _tokens((4, 33), seed=2)}
    tx = optax.adam(3e-3)

    @jax.jit
    def step(params, opt_state):
        loss_fn = lambda p: next_token_loss(nnx.merge(graphdef, p), batch)  # noqa: E731
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state, losses = tx.init(params), []
    for _ in range(20):
        params, opt_state, loss = step(params, opt_state)
        losses.append(float(loss))
    assert losses[-1] < 0.6 * losses[0], losses


def test_flops_per_token():
    c = GPTConfig.gpt2_124m()
    n = param_count(c) - c.max_seq_len * c.embed_dim  # the head matmul counts wte once
    assert flops_per_token(c, 1024) == 6 * n + 12 * 12 * 1024 * 768 == 855_327_744
    assert flops_per_token(c) == flops_per_token(c, c.max_seq_len)
    untied = GPTConfig.gpt2_124m(tie_embeddings=False)
    assert flops_per_token(untied, 512) == flops_per_token(c, 512)  # same matmuls


def test_flops_per_token_matches_the_compiled_program():
    # One layer, so the scan body XLA counts once is the whole model; the compiled count
    # also has the elementwise work (softmax, norms, GELU, Adam-free grads) on top.
    config, (b, t) = GPTConfig.tiny(num_layers=1), (2, 32)
    graphdef, state = nnx.split(_abstract(config))
    grad = jax.grad(lambda s, x: next_token_loss(nnx.merge(graphdef, s), {"tokens": x}))
    cost = jax.jit(grad).lower(state, jax.ShapeDtypeStruct((b, t + 1), jnp.int32)).compile()
    # The loss's loop over sequence chunks counted as many times as it runs (XLA's own
    # cost_analysis counts a loop body once).
    ratio = executed_cost(cost).flops / (b * t * flops_per_token(config, t))
    assert 0.95 < ratio < 1.15, ratio


@pytest.mark.slow
def test_trains_under_data_and_tensor_parallel_like_one_device(loss):
    # The logical names meet a real strategy: params and activations resolve on a
    # data x tensor mesh, and the loss is the one-device loss.
    import parallax as px

    mesh = px.make_mesh(data=-1, tensor=2)
    strategy = px.compose(px.DataParallel("data"), px.TensorParallel("tensor"))
    state = px.init(
        lambda: px.TrainState.create(GPT(TINY, rngs=nnx.Rngs(0)), optax.sgd(0.1)), mesh, strategy
    )
    qkv = state.params["blocks"]["attn"]["qkv"]["kernel"][...]  # [L, D, 3, H, K]
    assert qkv.sharding.spec == jax.P(None, None, None, "tensor")  # heads split, q/k/v whole

    @px.train_step(mesh, strategy)
    def step(state, batch):
        value, grads = px.value_and_grad(next_token_loss)(state.model, batch)
        return state.apply_gradients(grads), {"loss": value}

    tokens = _tokens((4, 17))
    _, metrics = step(state, {"tokens": tokens})
    np.testing.assert_allclose(metrics["loss"], loss(tokens), rtol=1e-5)


def test_config_validation():
    with pytest.raises(ValueError, match=r"GPTConfig: embed_dim=100 is not divisible by "
                       r"num_heads=3; set embed_dim to a multiple of num_heads \(e.g. 99\)"):
        GPTConfig.tiny(embed_dim=100, num_heads=3)
    with pytest.raises(ValueError, match=r"GPTConfig: num_layers must be a positive int, got 0; "
                       r"set num_layers to an integer >= 1"):
        GPTConfig.tiny(num_layers=0)
    with pytest.raises(ValueError, match=r"GPTConfig: vocab_size must be a positive int, got 2.5"):
        GPTConfig.tiny(vocab_size=2.5)
    with pytest.raises(TypeError, match=r"GPT: config must be a GPTConfig, got dict"):
        GPT({"vocab_size": 8}, rngs=nnx.Rngs(0))


def test_input_errors(model):
    with pytest.raises(ValueError, match=r"GPT.embed: sequence length 65 exceeds max_seq_len=64"):
        model.embed(_tokens((1, 65)))
    with pytest.raises(TypeError, match=r"GPT.embed: tokens must be integer ids, got dtype float"):
        model.embed(jnp.zeros((1, 4)))
    with pytest.raises(ValueError, match=r"GPT.embed: tokens must be \[batch, seq\], got \[4\]"):
        model.embed(_tokens((4,)))
    with pytest.raises(ValueError, match=r"next_token_loss: batch\['tokens'\] must have shape"):
        next_token_loss(model, {"tokens": _tokens((2, 1))})


def test_token_ids_outside_the_vocabulary_are_refused_where_they_are_concrete(model, loss):
    """An id >= vocab_size has no embedding row and no logit: the loss is NaN (issue 24,
    case 8). Concrete ids are refused, naming the id, where it is and the fix; a target
    only (the last column, never embedded) too. Under jit the ids are abstract: the loss
    is NaN there, and px.train_step(check_finite=True) names the check
    (tests/test_bad_input.py)."""
    tokens = np.asarray(_tokens((2, 17)))
    target_only = tokens.copy()
    target_only[1, 16] = TINY.vocab_size + 44
    with pytest.raises(ValueError, match=r"next_token_loss: token id 300 at tokens\[1, 16\] is "
                       r"outside the vocabulary \[0, 256\) \(1 such ids\); it has no embedding "
                       r"row and no logit, so the loss would be NaN. Map the ids into the "
                       r"vocabulary, or raise GPTConfig.vocab_size to at least 301."):
        next_token_loss(model, {"tokens": target_only})
    negative = tokens.copy()
    negative[0, 3] = -1
    with pytest.raises(ValueError, match=r"GPT.embed: token id -1 at tokens\[0, 3\] is outside"):
        model(jnp.asarray(negative[:, :-1]))
    assert np.isnan(float(loss(jnp.asarray(target_only))))  # what jit alone would give


@pytest.mark.slow
def test_padded_vocabulary_changes_nothing_but_the_shapes():
    # Padded to a multiple of 8 (for tensor parallelism): the real rows start equal, the
    # padded logits are masked, so loss and gradients are the unpadded model's.
    plain_config = GPTConfig.tiny(num_layers=1, vocab_size=250)
    padded_config = GPTConfig.tiny(num_layers=1, vocab_size=250, vocab_pad_multiple=8)
    assert padded_config.padded_vocab_size == 256
    assert param_count(padded_config) == param_count(plain_config) + 6 * 64
    tokens = _tokens((2, 17)) % 250

    def value_and_grad(config):
        graphdef, params = nnx.split(GPT(config, rngs=nnx.Rngs(0)), nnx.Param)
        fn = lambda p: next_token_loss(nnx.merge(graphdef, p), {"tokens": tokens})  # noqa: E731
        return params, jax.jit(jax.value_and_grad(fn))(params)

    plain, (plain_loss, plain_grads) = value_and_grad(plain_config)
    padded, (padded_loss, padded_grads) = value_and_grad(padded_config)
    np.testing.assert_array_equal(padded["wte"][...][:250], plain["wte"][...])
    assert not np.any(padded["wte"][...][250:])
    np.testing.assert_allclose(padded_loss, plain_loss, rtol=1e-6)
    np.testing.assert_allclose(padded_grads["wte"][...][:250], plain_grads["wte"][...],
                               rtol=1e-5, atol=1e-8)
    assert not np.any(padded_grads["wte"][...][250:])
    with pytest.raises(ValueError, match=r"GPTConfig: vocab_pad_multiple must be a positive "
                                         r"int, got 0; set vocab_pad_multiple to an integer >= 1"):
        GPTConfig.tiny(vocab_pad_multiple=0)
