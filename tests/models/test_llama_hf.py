"""px.models.Llama against Hugging Face's LlamaForCausalLM with the same weights (1e-5).

Skipped unless ``transformers`` and ``torch`` are installed (neither is a dependency).
"""

import numpy as np
import pytest
from flax import nnx

from parallax.models import Llama, LlamaConfig, RopeScaling

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _hf_model(c: LlamaConfig):
    rope = {"rope_type": "default", "rope_theta": c.rope_theta}
    if c.rope_scaling is not None:
        s = c.rope_scaling
        rope |= {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                 "high_freq_factor": s.high_freq_factor,
                 "original_max_position_embeddings": s.original_max_position_embeddings}
    config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.embed_dim, intermediate_size=c.mlp_dim,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads, max_position_embeddings=c.max_seq_len,
        rms_norm_eps=c.norm_eps, rope_parameters=rope, tie_word_embeddings=c.tie_embeddings)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _copy_weights(hf, model: Llama):
    """Hugging Face's ``[out, in]`` matrices into the Llama's ``[in, (heads,) out]`` kernels."""
    c = model.config
    d, h, g, k = c.embed_dim, c.num_heads, c.num_kv_heads, c.head_dim
    w = {name: p.detach().numpy() for name, p in hf.named_parameters()}
    layers = [f"model.layers.{i}." for i in range(c.num_layers)]

    def stack(name, fn):
        return np.stack([fn(w[prefix + name]) for prefix in layers])

    b = model.blocks
    b.attn.query.kernel[...] = stack("self_attn.q_proj.weight", lambda x: x.T.reshape(d, h, k))
    b.attn.key.kernel[...] = stack("self_attn.k_proj.weight", lambda x: x.T.reshape(d, g, k))
    b.attn.value.kernel[...] = stack("self_attn.v_proj.weight", lambda x: x.T.reshape(d, g, k))
    b.attn.out.kernel[...] = stack("self_attn.o_proj.weight", lambda x: x.T.reshape(h, k, d))
    b.mlp.gate.kernel[...] = stack("mlp.gate_proj.weight", lambda x: x.T)
    b.mlp.up.kernel[...] = stack("mlp.up_proj.weight", lambda x: x.T)
    b.mlp.down.kernel[...] = stack("mlp.down_proj.weight", lambda x: x.T)
    b.attn_norm.scale[...] = stack("input_layernorm.weight", lambda x: x)
    b.mlp_norm.scale[...] = stack("post_attention_layernorm.weight", lambda x: x)
    model.embed[...] = w["model.embed_tokens.weight"]
    model.norm.scale[...] = w["model.norm.weight"]
    if model.head is not None:
        model.head[...] = w["lm_head.weight"].T


@pytest.mark.parametrize("config", [
    LlamaConfig.tiny(),  # grouped-query attention, Llama 3.1's RoPE scaling, untied head
    LlamaConfig.tiny(num_kv_heads=4, rope_scaling=None, rope_theta=500000.0,
                     tie_embeddings=True),
], ids=["gqa-llama3-rope", "mha-tied"])
def test_same_logits_as_hugging_face(config):
    hf = _hf_model(config)
    model = Llama(config, rngs=nnx.Rngs(0))
    _copy_weights(hf, model)
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (2, 48))
    with torch.no_grad():
        expected = hf(torch.from_numpy(tokens)).logits.numpy()
    logits = np.asarray(model(tokens.astype(np.int32)))
    scale = np.abs(expected).max()
    assert np.abs(logits - expected).max() <= 1e-5 * max(scale, 1.0)


def test_rope_scaling_fields_are_hugging_faces():
    assert set(RopeScaling.__dataclass_fields__) == {
        "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
