"""The Llama with MoE blocks (Mixtral): its config and counts, Mixtral's pooled auxiliary
loss against a re-computation of transformers' formula, one device's training under data x
expert x tensor (whole state, 3 steps), mixtral checkpoints read as slices, and the
refusals. The transformers round trips: tests/models/test_mixtral_hf.py."""

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fixtures as fx
import parallax as px
from parallax.models import Llama, LlamaConfig, MoEConfig
from parallax.models.gpt_moe import pooled_balance_loss
from parallax.nn.moe_routing import route, router_stats

MIXTRAL = MoEConfig(num_experts=4, top_k=2, capacity_factor=None, aux_loss="mixtral",
                    balance_coef=0.02)


def config(**overrides):
    return LlamaConfig(**dict(vocab_size=96, max_seq_len=16, num_layers=2, num_heads=4,
                              num_kv_heads=2, embed_dim=32, mlp_dim=48, moe=MIXTRAL) | overrides)


def test_config_counts_and_layout():
    model = Llama(config(), rngs=nnx.Rngs(0))
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert px.models.llama_param_count(model.config) == sum(x.size for x in leaves)
    assert px.models.llama_param_count(LlamaConfig.mixtral_8x7b()) == 46702792704
    assert model.blocks.mlp.w_gate.get_metadata()["out_sharding"] == ("layers", "expert",
                                                                       "embed", "mlp")
    with pytest.raises(TypeError, match=r"LlamaConfig: moe must be a MoEConfig or None, got "
                       r"dict: \{'num_experts': 4\}; e\.g\. moe=MoEConfig\(num_experts=8"):
        config(moe={"num_experts": 4})


def test_aux_loss_conventions_refuse_what_they_lack():
    assert MoEConfig().router_z_coef == 0.001 and MIXTRAL.router_z_coef == 0.0
    with pytest.raises(ValueError, match=r"MoEConfig: z_coef=0.001 with aux_loss='mixtral': "
                       r"Mixtral's auxiliary loss has no router z-loss; leave z_coef=None"):
        MoEConfig(aux_loss="mixtral", z_coef=0.001)
    with pytest.raises(ValueError, match=r"MoEConfig: aux_loss='gshard' must be one of "
                       r"\('switch', 'mixtral'\)"):
        MoEConfig(aux_loss="gshard")


def _transformers_formula(logits_per_layer, top_k):
    """load_balancing_loss_func of transformers' modeling_mixtral, re-computed in numpy:
    every layer's tokens pooled, f_e the choices per token, P_e the mean probability."""
    logits = np.concatenate([np.asarray(x).reshape(-1, x.shape[-1]) for x in logits_per_layer])
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    chosen = np.argsort(-probs, axis=-1)[:, :top_k]
    counts = np.stack([np.bincount(chosen.reshape(-1), minlength=probs.shape[-1])])[0]
    return probs.shape[-1] * np.sum(counts / len(probs) * probs.mean(0))


def test_pooled_loss_is_transformers_formula():
    logits = jax.random.normal(jax.random.key(0), (3, 2, 8, 4))  # 3 layers, [G, S, E]
    stats = [router_stats(x, (r := route(x, 2, "softmax")), jnp.ones(r.experts.shape, bool), 4,
                          lambda v: v) for x in logits]
    load = jnp.stack([s["expert_load"] for s in stats])
    importance = jnp.stack([s["expert_importance"] for s in stats])
    ours = float(pooled_balance_loss(load, importance, top_k=2))
    assert abs(ours - _transformers_formula(list(logits), 2)) <= 1e-6
    switch = float(sum(s["load_balance_loss"] for s in stats))  # the default convention
    assert abs(ours - switch) > 0.1  # about 2x per layer, summed over 3: not the same loss


def _state(cfg):
    # Momentum SGD, as tests/fixtures.py explains: Adam's first step turns gradients that are
    # zero but for rounding into full-size updates whose sign no reduction order reproduces.
    return lambda: px.TrainState.create(Llama(cfg, rngs=nnx.Rngs(0)),
                                        optax.sgd(0.1, momentum=0.9))


def _run(state, step):
    rng = np.random.default_rng(0)
    states = []
    for _ in range(3):
        batch = {"tokens": rng.integers(0, 96, (8, 17)).astype(np.int32)}
        state, aux = step(state, batch)
        states.append(jax.device_get((jax.tree.leaves(state), aux)))
    return states


@pytest.mark.slow
def test_data_expert_tensor_equals_one_device():
    cfg = config()
    state = _state(cfg)()

    @jax.jit
    def plain(state, batch):
        def loss(params):
            return px.models.moe_next_token_loss(nnx.merge(state.graphdef, params, state.rest),
                                                 batch)

        (_, aux), grads = jax.value_and_grad(loss, has_aux=True)(state.params)
        return state.apply_gradients(grads), aux

    mesh = px.make_mesh(data=2, expert=2, tensor=2)
    strategy = px.compose(px.DataParallel("data"), px.ExpertParallel("expert"),
                          px.TensorParallel("tensor"))

    @px.train_step(mesh, strategy)
    def parallel(state, batch):
        (_, aux), grads = px.value_and_grad(px.models.moe_next_token_loss, has_aux=True)(
            state.model, batch)
        return state.apply_gradients(grads), aux

    sharded = px.init(_state(cfg), mesh, strategy)
    assert sharded.model.blocks.mlp.w_gate[...].sharding.spec == jax.P(None, "expert", None,
                                                                        "tensor")
    for i, (par, ref) in enumerate(zip(_run(sharded, parallel), _run(state, plain))):
        diff = px.testing.relative_difference(par, ref)
        assert diff <= 1e-5, f"step {i + 1}: whole state and statistics differ by {diff:.2e}"


def test_each_device_reads_only_its_experts(tmp_path, monkeypatch):
    model = Llama(config(), rngs=nnx.Rngs(0))
    px.models.save_pretrained(tmp_path, model)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "mixtral" and saved["num_local_experts"] == 4
    assert saved["output_router_logits"] and saved["router_aux_loss_coef"] == 0.02
    reads = fx.counted_checkpoint_reads(monkeypatch)
    mesh = px.make_mesh(expert=4, tensor=2)
    strategy = px.compose(px.ExpertParallel("expert"), px.TensorParallel("tensor"))
    loaded = px.models.from_pretrained(tmp_path, mesh=mesh, strategy=strategy)
    w1 = [b for n, b in reads if n == "model.layers.0.block_sparse_moe.experts.1.w1.weight"]
    assert w1 == [32 * 48 * 4 // 2] * 2  # expert 1's two devices: half of its columns each
    expert_bytes = sum(b for n, b in reads if ".experts." in n)
    assert expert_bytes == 2 * 4 * 3 * 32 * 48 * 4  # every expert weight read exactly once
    assert loaded.config == model.config
    jax.tree.map(np.testing.assert_array_equal,
                 jax.tree.map(np.asarray, nnx.state(loaded, nnx.Param)),
                 jax.tree.map(np.asarray, nnx.state(model, nnx.Param)))


def _write(tmp_path, **changes):
    px.models.save_pretrained(tmp_path, Llama(config(), rngs=nnx.Rngs(0)))
    path = tmp_path / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))
    return tmp_path


def test_checkpoint_semantics_and_refusals(tmp_path):
    quiet = px.models.from_pretrained(_write(tmp_path / "a", output_router_logits=False))
    assert quiet.config.moe.balance_coef == 0.0  # transformers adds it only when asked
    windowed = px.models.from_pretrained(_write(tmp_path / "b", sliding_window=8))
    assert windowed.config.max_seq_len == 8
    with pytest.raises(ValueError, match=r"max_seq_len=16 exceeds the Mixtral config's "
                       r"sliding_window=8; .* use max_seq_len <= 8"):
        px.models.from_pretrained(tmp_path / "b", max_seq_len=16)
    with pytest.warns(UserWarning, match=r"Mixtral config router_jitter_noise=0.1 asks for "
                      r"training-time noise that parallax's Llama does not have"):
        px.models.from_pretrained(_write(tmp_path / "c", router_jitter_noise=0.1))
    with pytest.raises(ValueError, match=r"px.models.from_pretrained: Mixtral config "
                       r"num_experts_per_tok=1 is not supported"):
        px.models.from_pretrained(_write(tmp_path / "d", num_experts_per_tok=1))
    sigmoid = Llama(config(moe=MoEConfig(num_experts=4, score="sigmoid")), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"save_pretrained: MoEConfig\(score='sigmoid'\) has "
                       r"no Mixtral equivalent"):
        px.models.save_pretrained(tmp_path / "e", sigmoid)


def test_pipelines_refuse_what_they_cannot_carry():
    tokens = {"tokens": jnp.ones((2, 9), jnp.int32)}
    with pytest.raises(ValueError, match=r"llama_stages: a Llama with MoE blocks"):
        px.models.llama_stages(Llama(config(), rngs=nnx.Rngs(0)), tokens)
    from parallax.models.gpt_pipeline import next_token_stages
    gpt = px.models.GPT(px.models.GPTConfig.tiny(moe=MIXTRAL), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"next_token_stages: an MoE GPT with "
                       r"MoEConfig\(aux_loss='mixtral'\) pools its router statistics"):
        next_token_stages(gpt, tokens)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        px.models.moe_next_token_loss(gpt, tokens)  # and the GPT takes the convention
