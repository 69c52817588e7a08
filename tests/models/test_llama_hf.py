"""px.models.Llama against Hugging Face's LlamaForCausalLM with the same weights (1e-5),
loaded with px.models.from_pretrained from transformers' own files and saved back.

Skipped unless ``transformers`` and ``torch`` are installed (neither is a dependency).
"""

import numpy as np
import pytest
from flax import nnx

import parallax as px
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


@pytest.mark.slow
@pytest.mark.parametrize("config", [
    LlamaConfig.tiny(),  # grouped-query attention, Llama 3.1's RoPE scaling, untied head
    LlamaConfig.tiny(num_kv_heads=4, rope_scaling=None, rope_theta=500000.0,
                     tie_embeddings=True),
], ids=["gqa-llama3-rope", "mha-tied"])
def test_same_logits_as_hugging_face(config, tmp_path):
    """transformers' own files -> px.models.from_pretrained (sharded), and back."""
    hf = _hf_model(config)
    hf.save_pretrained(tmp_path / "hf")
    mesh = px.make_mesh(data=2, fsdp=2, tensor=2)
    strategy = px.compose(px.DataParallel("data"), px.FSDP("fsdp"), px.TensorParallel("tensor"))
    model = px.models.from_pretrained(tmp_path / "hf", mesh=mesh, strategy=strategy,
                                      max_seq_len=config.max_seq_len)
    assert model.config == config
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (2, 48))
    with torch.no_grad():
        expected = hf(torch.from_numpy(tokens)).logits.numpy()
    scale = max(np.abs(expected).max(), 1.0)
    assert np.abs(np.asarray(model(tokens.astype(np.int32))) - expected).max() <= 1e-5 * scale

    ours = Llama(config, rngs=nnx.Rngs(7))  # and ours, saved, into transformers
    px.models.save_pretrained(tmp_path / "ours", ours)
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        theirs = back(torch.from_numpy(tokens)).logits.numpy()
    assert np.abs(np.asarray(ours(tokens.astype(np.int32))) - theirs).max() <= 1e-5 * max(
        np.abs(theirs).max(), 1.0)


def test_rope_scaling_fields_are_hugging_faces():
    assert set(RopeScaling.__dataclass_fields__) == {
        "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
