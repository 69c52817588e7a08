"""What from_pretrained does with a checkpoint's config beyond the sizes: GPT-2's dropout
turned on (and said so), a field the model lacks named in a warning (one test each), and
the errors for a missing shard and a PyTorch ``.bin`` checkpoint."""

import json
import warnings

import jax
import numpy as np
import pytest
from flax import nnx

import parallax as px
from parallax.models import GPT, GPTConfig, from_pretrained, save_pretrained
from parallax.models.pretrained.config_warnings import PretrainedConfigWarning

RATES = dict(embed_dropout=0.1, attention_dropout=0.1, residual_dropout=0.1)
TOKENS = np.random.default_rng(0).integers(0, 96, (2, 16)).astype(np.int32)


def config(**overrides):
    return GPTConfig(vocab_size=96, max_seq_len=32, num_layers=2, num_heads=4, embed_dim=32,
                     mlp_dim=128, **overrides)


def saved(tmp_path, **overrides):
    save_pretrained(tmp_path, GPT(config(**overrides), rngs=nnx.Rngs(0)))
    return json.loads((tmp_path / "config.json").read_text())


def edit_config(tmp_path, **fields):
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(hf | fields))


def key_data(tree):
    return jax.tree.map(lambda x: np.asarray(jax.random.key_data(x)) if jax.dtypes.issubdtype(
        x.dtype, jax.dtypes.prng_key) else np.asarray(x), jax.device_get(tree))


@pytest.mark.slow
def test_a_gpt2_checkpoint_with_dropout_turns_it_on_and_says_so(tmp_path):
    hf = saved(tmp_path, **RATES)
    assert (hf["embd_pdrop"], hf["attn_pdrop"], hf["resid_pdrop"]) == (0.1, 0.1, 0.1)
    mesh = px.make_mesh(data=2, tensor=2, devices=jax.devices()[:4])
    strategy = px.compose(px.DataParallel(), px.TensorParallel())
    with pytest.warns(PretrainedConfigWarning, match=(
            r"px.models.from_pretrained: the GPT-2 config asks for dropout \(embd_pdrop=0.1, "
            r"attn_pdrop=0.1, resid_pdrop=0.1\); the model trains with it \(GPTConfig "
            r"embed_dropout=0.1, attention_dropout=0.1, residual_dropout=0.1\).*Call "
            r"model.eval\(\) to evaluate.*pass embed_dropout=0.0, attention_dropout=0.0, "
            r"residual_dropout=0.0 to from_pretrained")):
        model = from_pretrained(tmp_path, mesh=mesh, strategy=strategy, dropout_seed=5)
    assert model.config == config(**RATES) and model.dropout_active()
    # the dropout streams are the constructor's, placed on the mesh
    expected = GPT(config(**RATES), rngs=nnx.Rngs(0, dropout=5))
    ours, theirs = (key_data(nnx.state(m, nnx.RngState)) for m in (model, expected))
    jax.tree.map(np.testing.assert_array_equal, ours, theirs)
    assert all(leaf.sharding.mesh.shape == mesh.shape
               for leaf in jax.tree.leaves(nnx.state(model, nnx.RngState)))
    model.eval()
    expected.eval()
    np.testing.assert_allclose(model(TOKENS), expected(TOKENS), rtol=1e-5, atol=1e-6)


def test_a_transformers_config_without_the_fields_has_their_default_of_0_1(tmp_path):
    saved(tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    for field in ("embd_pdrop", "attn_pdrop", "resid_pdrop"):
        del hf[field]
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.warns(PretrainedConfigWarning, match=r"asks for dropout"):
        assert from_pretrained(tmp_path).config.residual_dropout == 0.1


def test_overrides_turn_the_dropout_off_without_a_word(tmp_path):
    saved(tmp_path, **RATES)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PretrainedConfigWarning)
        model = from_pretrained(tmp_path, **{field: 0.0 for field in RATES})
    assert not model.config.has_dropout and not jax.tree.leaves(nnx.state(model, nnx.RngState))


def test_a_checkpoint_without_dropout_loads_without_a_word(tmp_path):
    saved(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PretrainedConfigWarning)
        assert not from_pretrained(tmp_path).config.has_dropout


def test_gpt2_reorder_and_upcast_attn_is_named(tmp_path):
    saved(tmp_path)
    edit_config(tmp_path, reorder_and_upcast_attn=True)
    with pytest.warns(PretrainedConfigWarning, match=(
            r"the GPT-2 config asks for reorder_and_upcast_attn=True, which parallax's model "
            r"does not do: it computes the attention scores in the compute dtype.*set "
            r"reorder_and_upcast_attn=False in config.json")):
        from_pretrained(tmp_path)


def test_gpt2_cross_attention_is_refused(tmp_path):
    saved(tmp_path)
    edit_config(tmp_path, add_cross_attention=True)
    with pytest.raises(ValueError, match=r"GPT-2 config add_cross_attention=True is not "
                                         r"supported"):
        from_pretrained(tmp_path)


@pytest.mark.slow
def test_llama_attention_dropout_is_named(tmp_path):
    c = px.models.LlamaConfig(vocab_size=96, max_seq_len=32, num_layers=1, num_heads=4,
                              num_kv_heads=2, embed_dim=32, mlp_dim=64)
    save_pretrained(tmp_path, px.models.Llama(c, rngs=nnx.Rngs(0)))
    edit_config(tmp_path, attention_dropout=0.1)
    with pytest.warns(PretrainedConfigWarning, match=(
            r"px.models.from_pretrained: the Llama config asks for attention_dropout=0.1, "
            r"which parallax's model does not do: parallax's Llama has no dropout")):
        from_pretrained(tmp_path)


def test_a_shard_named_by_the_index_but_missing_is_named(tmp_path):
    save_pretrained(tmp_path, GPT(config(), rngs=nnx.Rngs(0)), max_shard_bytes=40_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (tmp_path / shard).unlink()
    with pytest.raises(FileNotFoundError, match=(
            r"px.models.from_pretrained: .*model.safetensors.index.json names the shard "
            rf"'{shard}' \(holding \d+ tensors, e.g. '.*'\), which is not in .*; the download "
            r"or copy is incomplete")):
        from_pretrained(tmp_path)


def test_a_pytorch_bin_checkpoint_gets_transformers_5_advice(tmp_path):
    saved(tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=(
            r"has neither model.safetensors nor model.safetensors.index.json \(found: "
            r"config.json, pytorch_model.bin\); parallax reads safetensors only. To convert a "
            r"PyTorch .bin checkpoint, load it with transformers and save it again: "
            r"AutoModelForCausalLM.from_pretrained\(src\).save_pretrained\(dst\) writes "
            r"safetensors \(transformers 5 always does; transformers 4 needs "
            r"safe_serialization=True\)")):
        from_pretrained(tmp_path)


@pytest.mark.slow
def test_a_dropout_model_saves_its_rates_and_transformers_reads_them(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    saved(tmp_path, embed_dropout=0.1, attention_dropout=0.2, residual_dropout=0.3)
    hf = transformers.GPT2Config.from_pretrained(tmp_path)
    assert (hf.embd_pdrop, hf.attn_pdrop, hf.resid_pdrop) == (0.1, 0.2, 0.3)
