"""Qwen2 (a Llama with q/k/v biases) against Hugging Face's Qwen2ForCausalLM, both ways:
transformers' files loaded under data x fsdp x tensor, ours saved and read back by
transformers; logits within 1e-5, with random biases in both directions.

Skipped unless ``transformers`` and ``torch`` are installed (neither is a dependency).
"""

import json

import jax
import numpy as np
import pytest
from flax import nnx

import parallax as px

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _close(ours, theirs):
    assert np.abs(np.asarray(ours) - theirs).max() <= 1e-5 * max(np.abs(theirs).max(), 1.0)


@pytest.mark.slow
def test_qwen2_both_ways(tmp_path):
    config = transformers.Qwen2Config(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # transformers initialises biases at zero: make them count
        for name, param in hf.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.5)
    hf.save_pretrained(tmp_path / "hf")
    mesh = px.make_mesh(data=2, fsdp=2, tensor=2)
    strategy = px.compose(px.DataParallel("data"), px.FSDP("fsdp"), px.TensorParallel("tensor"))
    model = px.models.from_pretrained(tmp_path / "hf", mesh=mesh, strategy=strategy)
    assert model.config.qkv_bias and model.blocks.attn.query.bias.shape == (2, 4, 8)
    tokens = np.random.default_rng(0).integers(0, 96, (2, 16))
    with torch.no_grad():
        _close(model(tokens.astype(np.int32)), hf(torch.from_numpy(tokens)).logits.numpy())

    ours = px.models.Llama(model.config, rngs=nnx.Rngs(7))
    for bias in (ours.blocks.attn.query.bias, ours.blocks.attn.key_value.bias):
        bias[...] = 0.5 * jax.random.normal(jax.random.key(1), bias.shape)
    px.models.save_pretrained(tmp_path / "ours", ours)
    saved = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert saved["model_type"] == "qwen2" and saved["architectures"] == ["Qwen2ForCausalLM"]
    back = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        _close(ours(tokens.astype(np.int32)), back(torch.from_numpy(tokens)).logits.numpy())

