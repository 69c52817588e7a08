"""px.models.from_pretrained / save_pretrained: Hugging Face checkpoints, both ways.

The round trips need ``transformers`` and ``torch`` (test-only peers, installed by .ci/run
on Python 3.11 where a CPU build of torch is available); the rest runs everywhere.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fixtures as fx
import parallax as px
from parallax.models import GPT, GPTConfig, from_pretrained, save_pretrained
from parallax.models.pretrained.config_warnings import PretrainedConfigWarning

TOKENS = np.random.default_rng(0).integers(0, 96, (2, 16)).astype(np.int32)
MESH_AXES = dict(data=2, fsdp=2, tensor=2)


def strategy():
    return px.compose(px.DataParallel("data"), px.FSDP("fsdp"), px.TensorParallel("tensor"))


def ours(seed=0, **overrides):
    config = GPTConfig(vocab_size=96, max_seq_len=32, num_layers=2, num_heads=4, embed_dim=32,
                       mlp_dim=128, **overrides)
    return GPT(config, rngs=nnx.Rngs(seed))


def params(model):
    return jax.tree.map(np.asarray, nnx.state(model, nnx.Param))


@pytest.mark.slow
def test_save_then_load_is_the_identity_in_any_layout(tmp_path):
    model = ours()
    save_pretrained(tmp_path, model)
    mesh = px.make_mesh(**MESH_AXES)
    loaded = from_pretrained(tmp_path, mesh=mesh, strategy=strategy())
    jax.tree.map(np.testing.assert_array_equal, params(loaded), params(model) | {})
    kernel = loaded.blocks.mlp.fc.kernel[...]
    assert kernel.sharding.spec == jax.P(None, "fsdp", "tensor")
    # sharded vs one device: the same parameters, sums in another order
    np.testing.assert_allclose(loaded(TOKENS), model(TOKENS), rtol=1e-5, atol=1e-6)


def test_each_device_reads_only_its_slice(tmp_path, monkeypatch):
    model = ours()
    save_pretrained(tmp_path, model)
    reads = fx.counted_checkpoint_reads(monkeypatch)
    mesh = px.make_mesh(**MESH_AXES)
    loaded = from_pretrained(tmp_path, mesh=mesh, strategy=strategy())
    fc = loaded.blocks.mlp.fc.kernel[...]  # [L, D, F] over fsdp x tensor: a quarter per device
    per_layer = [n for n, _ in reads if n.endswith("h.0.mlp.c_fc.weight")]
    biggest = max(b for n, b in reads if n.endswith("h.0.mlp.c_fc.weight"))
    assert biggest == 32 * 128 * 4 // 4  # one device's quarter, never the whole matrix
    assert len(per_layer) == 8  # each of the 8 devices read its own quarter once
    assert fc.addressable_shards[0].data.shape == (2, 16, 64)


@pytest.mark.slow
def test_vocabulary_padding_and_sharded_index_files(tmp_path):
    model = ours(vocab_pad_multiple=64)  # 96 -> 128 rows, the last 32 zero
    save_pretrained(tmp_path, model, max_shard_bytes=40_000)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert "model.safetensors.index.json" in files and len(files) > 3
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["vocab_size"] == 96 and config["model_type"] == "gpt2"
    loaded = from_pretrained(tmp_path, vocab_pad_multiple=64)
    assert loaded.wte.shape == (128, 32)
    np.testing.assert_array_equal(np.asarray(loaded.wte[...])[96:], 0)
    np.testing.assert_allclose(loaded(TOKENS), model(TOKENS), rtol=1e-6)


@pytest.mark.slow
def test_llama_save_then_load_with_a_padded_untied_head(tmp_path):
    config = px.models.LlamaConfig(vocab_size=96, max_seq_len=32, num_layers=2, num_heads=4,
                                   num_kv_heads=2, embed_dim=32, mlp_dim=64,
                                   vocab_pad_multiple=64)  # head [D, 128] from lm_head [96, D]
    model = px.models.Llama(config, rngs=nnx.Rngs(0))
    save_pretrained(tmp_path, model)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llama"
    loaded = from_pretrained(tmp_path, mesh=px.make_mesh(**MESH_AXES), strategy=strategy(),
                             vocab_pad_multiple=64)
    assert loaded.config == config
    jax.tree.map(np.testing.assert_array_equal, params(loaded), params(model))
    np.testing.assert_allclose(loaded(TOKENS), model(TOKENS), rtol=1e-5, atol=1e-6)


def test_dtype_casts_the_stored_parameters(tmp_path):
    save_pretrained(tmp_path, ours())
    loaded = from_pretrained(tmp_path, dtype=jnp.bfloat16)
    assert loaded.blocks.mlp.fc.kernel.dtype == jnp.bfloat16


def test_compute_dtype_sets_the_compute_and_keeps_the_parameters(tmp_path):
    save_pretrained(tmp_path, GPT(GPTConfig.tiny(num_layers=1), rngs=nnx.Rngs(0)))
    model = from_pretrained(tmp_path, compute_dtype="bfloat16")
    assert model.config.dtype == jnp.bfloat16 and model.config.param_dtype == jnp.float32
    assert model.blocks.mlp.fc.kernel[...].dtype == jnp.float32
    assert model(jnp.ones((1, 4), jnp.int32)).dtype == jnp.float32  # float32 logits
    hidden = model.hidden_states(jnp.ones((1, 4), jnp.int32))
    assert hidden.dtype == jnp.bfloat16


def test_bad_checkpoints_get_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"px.models.from_pretrained: no config.json in "):
        from_pretrained(tmp_path)
    save_pretrained(tmp_path, ours())
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"model_type": "bert"}))
    with pytest.raises(ValueError, match=r"model_type 'bert' is not supported; parallax reads "):
        from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config | {"n_embd": 64}))
    with pytest.raises(ValueError, match=r"tensor 'transformer.h.0.attn.c_proj.bias' has shape "
                                         r"\[32\], which does not hold the model's "
                                         r"blocks.attn.out.bias \[2, 64\]"):
        from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config | {"activation_function": "relu"}))
    with pytest.raises(ValueError, match=r"GPT-2 config activation_function='relu' is not "
                                         r"supported"):
        from_pretrained(tmp_path)
    with pytest.raises(TypeError, match=r"px.models.save_pretrained: cannot save a MLP"):
        save_pretrained(tmp_path, px.models.MLP(16, [32], 16, rngs=nnx.Rngs(0)))


# --- round trips with transformers' own GPT-2 ---------------------------------------------

def hf_gpt2(seed=0):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2,
                                     n_head=4)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # every bias random too, the key bias included (softmax cancels it)
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return torch, transformers, model


def hf_logits(torch, model, tokens):
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


@pytest.mark.slow
def test_transformers_gpt2_loads_with_the_same_logits(tmp_path):
    torch, _, hf = hf_gpt2()
    hf.save_pretrained(tmp_path)  # transformers' own files, with GPT-2's dropout of 0.1
    mesh = px.make_mesh(**MESH_AXES)
    with pytest.warns(PretrainedConfigWarning, match=r"asks for dropout \(embd_pdrop=0.1"):
        loaded = from_pretrained(tmp_path, mesh=mesh, strategy=strategy())
    assert loaded.config.attention_dropout == 0.1 and loaded.dropout_active()
    loaded.eval()  # as transformers' model is
    np.testing.assert_allclose(np.asarray(loaded(TOKENS)), hf_logits(torch, hf, TOKENS),
                               rtol=1e-5, atol=1e-5)


def test_our_gpt_saves_into_transformers_with_the_same_logits(tmp_path):
    torch, transformers, _ = hf_gpt2()
    model = ours(seed=3)
    save_pretrained(tmp_path, model)
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    np.testing.assert_allclose(hf_logits(torch, hf, TOKENS), np.asarray(model(TOKENS)),
                               rtol=1e-5, atol=1e-5)


def test_qwen2_sliding_window_is_refused(tmp_path):
    model = px.models.Llama(px.models.LlamaConfig(
        vocab_size=96, max_seq_len=16, num_layers=1, num_heads=4, num_kv_heads=2,
        embed_dim=32, mlp_dim=64, qkv_bias=True), rngs=nnx.Rngs(0))
    px.models.save_pretrained(tmp_path, model)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"use_sliding_window": True}))
    with pytest.raises(ValueError, match=r"px.models.from_pretrained: Qwen2 config "
                       r"use_sliding_window=true is not supported"):
        px.models.from_pretrained(tmp_path)
