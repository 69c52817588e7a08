"""An MoE px.models.Llama against Hugging Face's MixtralForCausalLM: transformers' own files
loaded sharded over data x expert x tensor (logits within 1e-5), ours saved and loaded back
by transformers, and three AdamW steps of both (cross-entropy plus Mixtral's auxiliary loss)
with the same losses within 1e-6.

Skipped unless ``transformers`` and ``torch`` are installed (neither is a dependency).
"""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import parallax as px

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SEQ, VOCAB, COEF = 16, 96, 0.02


def _hf_model(**changes):
    config = transformers.MixtralConfig(**dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=32) | changes)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config).eval()


def _tokens(rows=4):
    return np.random.default_rng(0).integers(0, VOCAB, (rows, SEQ + 1))


@pytest.mark.slow
def test_same_logits_both_ways(tmp_path):
    hf = _hf_model()
    hf.save_pretrained(tmp_path / "hf")
    mesh = px.make_mesh(data=2, expert=2, tensor=2)
    strategy = px.compose(px.DataParallel("data"), px.ExpertParallel("expert"),
                          px.TensorParallel("tensor"))
    model = px.models.from_pretrained(tmp_path / "hf", mesh=mesh, strategy=strategy)
    assert model.config.moe == px.models.MoEConfig(
        num_experts=4, top_k=2, capacity_factor=None, aux_loss="mixtral", balance_coef=0.0)
    tokens = _tokens()
    with torch.no_grad():
        expected = hf(torch.from_numpy(tokens)).logits.numpy()
    scale = max(np.abs(expected).max(), 1.0)
    assert np.abs(np.asarray(model(tokens.astype(np.int32))) - expected).max() <= 1e-5 * scale

    ours = px.models.Llama(model.config, rngs=nnx.Rngs(7))  # and ours, saved, into transformers
    px.models.save_pretrained(tmp_path / "ours", ours)
    back = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        theirs = back(torch.from_numpy(tokens)).logits.numpy()
    assert np.abs(np.asarray(ours(tokens.astype(np.int32))) - theirs).max() <= 1e-5 * max(
        np.abs(theirs).max(), 1.0)


def _torch_losses(hf, batches, lr):
    """transformers' training loss: cross-entropy + router_aux_loss_coef * its aux_loss."""
    hf.train()  # router_jitter_noise is 0 and attention_dropout 0: no randomness
    opt = torch.optim.AdamW(hf.parameters(), lr=lr, weight_decay=0.01)
    losses = []
    for tokens in batches:
        out = hf(torch.from_numpy(tokens[:, :-1]), output_router_logits=True)
        ce = torch.nn.functional.cross_entropy(out.logits.reshape(-1, VOCAB),
                                               torch.from_numpy(tokens[:, 1:]).reshape(-1))
        loss = ce + hf.config.router_aux_loss_coef * out.aux_loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.slow
def test_three_adamw_steps_same_losses(tmp_path):
    hf = _hf_model(output_router_logits=True, router_aux_loss_coef=COEF)
    hf.save_pretrained(tmp_path)
    rng = np.random.default_rng(1)
    batches = [rng.integers(0, VOCAB, (4, SEQ + 1)) for _ in range(3)]
    theirs = _torch_losses(hf, batches, lr=1e-3)

    model = px.models.from_pretrained(tmp_path)
    assert model.config.moe.balance_coef == COEF and model.config.moe.router_z_coef == 0.0
    state = px.TrainState.create(model, optax.adamw(1e-3, weight_decay=0.01))

    @jax.jit
    def step(state, batch):
        def loss(params):
            model = nnx.merge(state.graphdef, params, state.rest)
            return px.models.moe_next_token_loss(model, batch)[0]

        value, grads = jax.value_and_grad(loss)(state.params)
        return state.apply_gradients(grads), value

    ours = []
    for tokens in batches:
        state, loss = step(state, {"tokens": tokens.astype(np.int32)})
        ours.append(float(loss))
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)
