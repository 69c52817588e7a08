"""px.models.generate: the cached decode equals a step-by-step argmax loop without a cache, and
transformers' greedy generate; the sampling warpers equal a written-out reference (and
transformers' own where installed); the sharded layout gives one device's tokens; bad input
is refused with a message; the training program does not change."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import parallax as px
from parallax.models import GPT, GPTConfig, Llama, LlamaConfig, generate
from parallax.models.sampling import warp_logits

GPT_SMALL = GPTConfig(vocab_size=96, max_seq_len=32, num_layers=2, num_heads=4, embed_dim=32,
                      mlp_dim=64)
LLAMA_SMALL = LlamaConfig.tiny(vocab_size=96, max_seq_len=32, num_layers=2)
PROMPT = np.random.default_rng(0).integers(0, 96, (4, 5)).astype(np.int32)


def argmax_loop(model, prompt, steps):
    """The reference: the whole sequence through the model each step, no cache."""
    tokens = jnp.asarray(prompt)
    for _ in range(steps):
        chosen = jnp.argmax(model(tokens)[:, -1], axis=-1).astype(jnp.int32)
        tokens = jnp.concatenate([tokens, chosen[:, None]], axis=1)
    return np.asarray(tokens)


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_greedy_equals_the_argmax_loop_without_a_cache(family):
    model = (GPT(GPT_SMALL, rngs=nnx.Rngs(1)) if family == "gpt"
             else Llama(LLAMA_SMALL, rngs=nnx.Rngs(1)))
    out = generate(model, PROMPT, 7)
    assert out.shape == (4, 12) and out.dtype == jnp.int32
    np.testing.assert_array_equal(out, argmax_loop(model, PROMPT, 7))


def test_a_model_in_train_mode_decodes_without_dropout_and_stays_in_train_mode():
    import dataclasses
    config = dataclasses.replace(GPT_SMALL, embed_dropout=0.5, attention_dropout=0.5,
                                 residual_dropout=0.5)
    model = GPT(config, rngs=nnx.Rngs(1))
    out = generate(model, PROMPT, 7)
    assert model.dropout_active()
    model.eval()
    np.testing.assert_array_equal(out, argmax_loop(model, PROMPT, 7))


def test_sampling_is_seeded_and_top_k_1_is_greedy():
    model = GPT(GPT_SMALL, rngs=nnx.Rngs(1))
    a = generate(model, PROMPT, 6, temperature=1.0, seed=4)
    np.testing.assert_array_equal(a, generate(model, PROMPT, 6, temperature=1.0, seed=4))
    assert not np.array_equal(a, generate(model, PROMPT, 6, temperature=1.0, seed=5))
    np.testing.assert_array_equal(generate(model, PROMPT, 6, temperature=0.7, top_k=1),
                                  generate(model, PROMPT, 6))


# --- the warpers: transformers' semantics, written out ------------------------------------

def reference_warp(logits, temperature, top_k, top_p):
    """transformers' TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper in numpy."""
    x = np.asarray(logits, np.float64) / temperature
    if top_k:
        kth = np.sort(x, axis=-1)[:, -min(top_k, x.shape[-1])][:, None]
        x = np.where(x < kth, -np.inf, x)
    if top_p is not None and top_p < 1:
        out = x.copy()
        for row, values in enumerate(x):
            order = np.argsort(values, kind="stable")
            p = np.exp(values[order] - values[order].max())
            cumulative = np.cumsum(p / p.sum())
            drop = cumulative <= 1 - top_p
            drop[-1] = False
            out[row, order[drop]] = -np.inf
        x = out
    return x


CASES = [(1.0, None, None), (0.5, None, None), (1.0, 5, None), (1.0, None, 0.8),
         (0.7, 10, 0.9), (2.0, 50, 0.3), (1.0, 1000, None), (1.0, None, 0.0)]


@pytest.mark.parametrize("temperature,top_k,top_p", CASES)
def test_warpers_follow_transformers_semantics(temperature, top_k, top_p):
    logits = np.random.default_rng(3).normal(size=(3, 40)).astype(np.float32) * 3
    ours = np.asarray(warp_logits(jnp.asarray(logits), temperature, top_k, top_p))
    expected = reference_warp(logits, temperature, top_k, top_p)
    np.testing.assert_array_equal(np.isinf(ours), np.isinf(expected))
    kept = ~np.isinf(expected)
    np.testing.assert_allclose(ours[kept], expected[kept], rtol=1e-6)


def test_warpers_equal_transformers_own():
    torch = pytest.importorskip("torch")
    lp = pytest.importorskip("transformers.generation.logits_process")
    logits = np.random.default_rng(4).normal(size=(3, 40)).astype(np.float32) * 3
    for temperature, top_k, top_p in CASES:
        scores = torch.from_numpy(logits.copy())
        if temperature != 1.0:
            scores = lp.TemperatureLogitsWarper(temperature)(None, scores)
        if top_k:
            scores = lp.TopKLogitsWarper(top_k)(None, scores)
        if top_p is not None:
            scores = lp.TopPLogitsWarper(top_p)(None, scores)
        ours = np.asarray(warp_logits(jnp.asarray(logits), temperature, top_k, top_p))
        np.testing.assert_allclose(ours, scores.numpy(), rtol=1e-6)


def test_sampled_tokens_stay_in_the_kept_set():
    model = Llama(LLAMA_SMALL, rngs=nnx.Rngs(2))
    out = np.asarray(generate(model, PROMPT[:1], 1, temperature=1.0, top_k=3, seed=9))
    top3 = np.argsort(np.asarray(model(PROMPT[:1])[0, -1]))[-3:]
    assert out[0, -1] in top3


# --- transformers' greedy generate on its own tiny checkpoints -----------------------------

def hf_greedy(torch, hf, prompt, steps):
    with torch.no_grad():
        return hf.generate(torch.from_numpy(prompt).long(), max_new_tokens=steps,
                           do_sample=False, attention_mask=torch.ones(prompt.shape).long(),
                           pad_token_id=0).numpy()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_greedy_equals_transformers_generate(family, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2,
                                         n_head=4)
        hf = transformers.GPT2LMHeadModel(config).eval()
    else:
        config = transformers.LlamaConfig(
            vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
        hf = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger weights than the init's: confident, tie-free argmaxes
        for p in hf.parameters():
            p.mul_(4.0) if p.ndim > 1 else None
    hf.save_pretrained(tmp_path)
    ours = px.models.from_pretrained(tmp_path)
    np.testing.assert_array_equal(np.asarray(generate(ours, PROMPT, 10)),
                                  hf_greedy(torch, hf, PROMPT, 10))


# --- in the training layout ----------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_sharded_weights_give_one_devices_tokens(family):
    model = (GPT(GPT_SMALL, rngs=nnx.Rngs(1)) if family == "gpt"
             else Llama(LLAMA_SMALL, rngs=nnx.Rngs(1)))
    mesh = px.make_mesh(data=2, fsdp=2, tensor=2)
    strategy = px.compose(px.DataParallel("data"), px.FSDP("fsdp"), px.TensorParallel("tensor"))
    sharded = px.shard(model, mesh, strategy)
    kernel = sharded.blocks.mlp.down.kernel if family == "llama" else sharded.blocks.mlp.fc.kernel
    assert not kernel[...].sharding.is_fully_replicated  # the weights stay sharded
    for kwargs in (dict(), dict(temperature=0.8, top_k=20, top_p=0.9, seed=3)):
        np.testing.assert_array_equal(
            generate(sharded, PROMPT, 6, mesh=mesh, strategy=strategy, **kwargs),
            generate(model, PROMPT, 6, **kwargs))


# --- bad input -----------------------------------------------------------------------------

@pytest.mark.parametrize("call,error,message", [
    (lambda m: generate(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), PROMPT, 2), TypeError,
     r"px.models.generate: model must be a px.models.GPT \(without MoE\) or a px.models.Llama, "
     r"got Linear"),
    (lambda m: generate(m, PROMPT.astype(np.float32), 2), TypeError,
     r"prompt_ids must be integer token ids \[batch, prompt\], got dtype float32"),
    (lambda m: generate(m, PROMPT[0], 2), ValueError,
     r"prompt_ids must be \[batch, prompt\] .* got shape \[5\]; a single prompt is ids\[None, :\]"),
    (lambda m: generate(m, PROMPT, 28), ValueError,
     r"the prompt \(5 tokens\) plus max_new_tokens=28 must be between 6 and the model's "
     r"max_seq_len=32 \(GPT's positions\); shorten the prompt"),
    (lambda m: generate(m, PROMPT, 0), ValueError, r"max_new_tokens=0 must be between 6"),
    (lambda m: generate(m, PROMPT + 96, 2), ValueError,
     r"prompt_ids must lie in \[0, 96\) \(the model's vocab_size\), got ids from 97 to"),
    (lambda m: generate(m, PROMPT, 2, temperature=-1.0), ValueError,
     r"temperature must be a finite float >= 0 \(0 is greedy\), got -1.0"),
    (lambda m: generate(m, PROMPT, 2, temperature="hot"), TypeError,
     r"temperature must be a float >= 0, got str 'hot'"),
    (lambda m: generate(m, PROMPT, 2, temperature=1.0, top_k=-2), ValueError,
     r"top_k must be >= 0 \(0 or None: off\), got -2"),
    (lambda m: generate(m, PROMPT, 2, temperature=1.0, top_k=2.5), TypeError,
     r"top_k must be None or an int >= 0, got float 2.5"),
    (lambda m: generate(m, PROMPT, 2, temperature=1.0, top_p=1.5), ValueError,
     r"top_p must be a float in \[0, 1\] \(1.0 or None: off\), got 1.5"),
    (lambda m: generate(m, PROMPT, 2, mesh=px.make_mesh(data=-1)), ValueError,
     r"pass mesh= and strategy= together"),
    (lambda m: generate(m, PROMPT[:3], 2, mesh=px.make_mesh(data=-1),
                        strategy=px.DataParallel("data")), ValueError,
     r"the prompt's 3 rows do not divide over the batch axes data=8 \(8 ways\)"),
    (lambda m: generate(m, PROMPT, 2, mesh=px.make_mesh(data=2, tensor=4),
                        strategy=px.compose(px.DataParallel("data"), px.TensorParallel(
                            "tensor", sequence_parallel=True))), ValueError,
     r"splits 'sequence' over .*tensor.*; decoding feeds one token at a time"),
])
def test_bad_input_is_refused_with_a_message(call, error, message):
    with pytest.raises(error, match=message):
        call(GPT(GPT_SMALL, rngs=nnx.Rngs(0)))


def test_top_k_under_greedy_warns_as_transformers_does():
    with pytest.warns(UserWarning, match=r"temperature=0 decodes greedily; top_k=5"):
        generate(GPT(GPT_SMALL, rngs=nnx.Rngs(0)), PROMPT, 1, top_k=5)


# --- the training path is untouched --------------------------------------------------------

@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_training_program_has_no_cache(family):
    model = (GPT(GPT_SMALL, rngs=nnx.Rngs(1)) if family == "gpt"
             else Llama(LLAMA_SMALL, rngs=nnx.Rngs(1)))
    batch = {"tokens": jnp.asarray(np.concatenate([PROMPT, PROMPT], axis=1))}
    graph, params = nnx.split(model)
    grad = jax.grad(lambda p: px.models.next_token_loss(nnx.merge(graph, p), batch))
    text = str(jax.make_jaxpr(grad)(params))
    assert "dynamic_update_slice" not in text and "fori" not in text
