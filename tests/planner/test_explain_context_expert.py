"""px.explain under context parallelism (ring, all-gather) and expert parallelism (MoE).

One compile per configuration (px.explain on abstract state): CP = 4 alone (GPT ring, Llama
all-gather with GQA), DP x CP x TP = 2 x 2 x 2 (GPT, both methods), DP x EP = 2 x 4 and an
MoE GPT with no expert axis. The context axis's rows and the all-to-alls must equal the
compiled program's bytes exactly, the state within 5%.
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import parallax as px
from parallax.nn.moe_dropless import most_rounds, round_slots
from parallax.planner.predicted import memory as predicted_memory
from parallax.planner.setting import read_setting

TX = optax.sgd(0.1, momentum=0.9)
STATE_ROWS = ("parameters", "optimizer state", "gradients", "arguments (state + batch)")
ROWS = 4  # global batch of the CP cases
CP_CASES = {
    "ring-cp4-gpt": ({"context": 4}, "ring", "gpt"),
    "all_gather-cp4-llama": ({"context": 4}, "all_gather", "llama"),
    "ring-dp2-cp2-tp2-gpt": ({"data": 2, "context": 2, "tensor": 2}, "ring", "gpt"),
    "all_gather-dp2-cp2-tp2-gpt": ({"data": 2, "context": 2, "tensor": 2}, "all_gather", "gpt"),
}


def model_config(family):
    if family == "llama":
        return px.models.LlamaConfig.tiny(max_seq_len=16)
    return px.models.GPTConfig.tiny(max_seq_len=32)


def make_state(family, config):
    model = px.models.Llama if family == "llama" else px.models.GPT
    return jax.eval_shape(lambda: px.TrainState.create(model(config, rngs=nnx.Rngs(0)), TX))


def context_strategy(axes, method):
    parts = [px.ContextParallel("context", method=method)]
    if "data" in axes:
        parts.insert(0, px.DataParallel("data"))
    if "tensor" in axes:
        parts.append(px.TensorParallel("tensor"))
    return px.compose(*parts)


def explained(mesh, strategy, state, batch, loss_fn, has_aux=False):
    @px.train_step(mesh, strategy)
    def step(state, batch):
        if has_aux:
            (loss, _), grads = px.value_and_grad(loss_fn, has_aux=True)(state.model, batch)
        else:
            loss, grads = px.value_and_grad(loss_fn)(state.model, batch)
        return state.apply_gradients(grads), {"loss": loss}

    return px.explain(step, state, batch)


@functools.cache
def cp_report(name):
    axes, method, family = CP_CASES[name]
    config = model_config(family)
    mesh = px.make_mesh(devices=jax.devices()[:8 if len(axes) == 3 else 4], **axes)
    batch = {"tokens": jax.ShapeDtypeStruct((ROWS, config.max_seq_len + 1), jnp.int32)}
    return config, explained(mesh, context_strategy(axes, method), make_state(family, config),
                             batch, px.models.next_token_loss)


def whole_tables(extra, table):
    """``extra`` bytes are a positive whole number of ``table``-byte matrices (up to the
    loss's few scalars, which the gradient rows leave out)."""
    count = round(extra / table)
    return count >= 1 and abs(extra - count * table) <= 256


def own_messages(config, axes, method):
    """ContextParallel's messages per step, from the papers' counts (independent of the
    planner's code): (kind -> bytes)."""
    n, t, rows = axes["context"], axes.get("tensor", 1), ROWS // axes.get("data", 1)
    T, L = config.max_seq_len, config.num_layers
    kv = 2 * rows * (T // n) * getattr(config, "num_kv_heads", config.num_heads) // t \
        * config.head_dim * 4  # one device's K and V, float32
    natural = 2 * (1 if n == 2 else 2) * rows * (T // (2 * n)) * config.embed_dim * 4
    if method == "ring":  # (n-1) forward, (n-1) + n backward: K,V and dK,dV
        return {"collective-permute": L * (3 * n - 2) * kv + natural}
    return {"all-gather": 2 * L * n * kv, "reduce-scatter": L * n * kv,
            "collective-permute": natural}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CP_CASES))
def test_context_parallel_rows_match_the_compiled_program(name):
    axes, method, family = CP_CASES[name]
    config, report = cp_report(name)
    t = axes.get("tensor", 1)
    table = 4 * config.padded_vocab_size * config.embed_dim  # one [V, D] float32 matrix
    for row in STATE_ROWS:
        if row == "gradients" and t == 1:
            # measured from the sum over context, where the embedding's and the output
            # matrix's gradients (lookup, chunked loss) are summed in parts (the all-reduce
            # row below holds the extra to whole tables): flagged with that reason
            found = report.row(row)
            assert found.measured - found.predicted >= table and found.flagged, report.text()
            assert "several parts" in found.reason
            continue
        assert report.row(row).ratio == pytest.approx(1, abs=0.05), report.text()
    for kind, nbytes in own_messages(config, axes, method).items():
        row = report.row(f"{kind} over context (ContextParallel)")
        assert row.predicted == nbytes and row.measured == nbytes, report.text()
    grads = report.row("all-reduce over context")  # GSPMD's sum over the context axis
    if t == 1:
        # The chunked loss's backward forms the output matrix's gradient apart from the
        # embedding lookup's, and GSPMD may sum those parts over context one by one: what
        # XLA adds over the prediction is whole [V, D] tables, and the row says why.
        extra = grads.measured - grads.predicted
        assert extra == 0 or whole_tables(extra, table), report.text()
        assert extra == 0 or "several parts" in grads.reason, report.text()
    else:  # with TP, XLA gathers the embedding's and head's activations instead
        assert grads.flagged and "gather an activation instead" in grads.reason
    for axis in ("data", "tensor"):
        if axis in axes:
            assert report.row(f"all-reduce over {axis}").ratio == pytest.approx(1, abs=0.05)
    assert report.row("matmul flops").ratio == pytest.approx(1, abs=0.06), report.text()
    temps = report.row("temporaries")
    assert temps.predicted and temps.measured and (not temps.flagged or temps.reason)


def test_context_parallel_activations_fall_as_one_over_cp():
    config = model_config("gpt")
    state = make_state("gpt", config)
    batch = {"tokens": jax.ShapeDtypeStruct((ROWS, config.max_seq_len + 1), jnp.int32)}
    act = {n: predicted_memory.activation_bytes(read_setting(
        px.make_mesh(devices=jax.devices()[:n], context=n), px.ContextParallel(), state,
        batch)).value for n in (2, 4)}
    assert act[2] == 2 * act[4]


EXPERTS, EMBED, SEQ, MOE_ROWS = 8, 32, 16, 16


@functools.cache
def moe_report(expert_parallel, capacity_factor=1.0, style=None):
    moe = px.models.MoEConfig(num_experts=EXPERTS, top_k=2, capacity_factor=capacity_factor)
    config = px.models.GPTConfig.tiny(embed_dim=EMBED, num_heads=2, mlp_dim=64,
                                      max_seq_len=SEQ, num_layers=2, moe=moe)
    if expert_parallel:
        mesh = px.make_mesh(data=2, expert=4)
        strategy = px.compose(px.DataParallel("data"), px.ExpertParallel("expert", style=style))
    else:
        mesh, strategy = px.make_mesh(data=8), px.DataParallel("data")
    batch = {"tokens": jax.ShapeDtypeStruct((MOE_ROWS, SEQ + 1), jnp.int32)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "parallax.nn.MoE: the strategy")
        return config, explained(mesh, strategy, make_state("gpt", config), batch,
                                 px.models.moe_next_token_loss, has_aux=True)


@pytest.mark.slow
def test_expert_parallel_rows_match_the_compiled_program():
    config, report = moe_report(True)
    for row in ("parameters", "optimizer state", "arguments (state + batch)",
                "expert weights"):
        assert report.row(row).ratio == 1, report.text()
    # gradients: measured as the sums over data and data+expert (router statistics too)
    assert report.row("gradients").ratio == pytest.approx(1, abs=1e-3)
    layers, g = config.num_layers, MOE_ROWS // 8
    slots = g * EXPERTS * config.moe.capacity(SEQ) * EMBED * 4  # [G, E, C, D] float32
    a2a = report.row("all-to-all over expert")  # 2 forward + 2 backward per MoE layer
    assert a2a.predicted == a2a.measured == 4 * layers * slots
    experts = 3 * EXPERTS * EMBED * 64 * 4 * layers  # w_gate, w_up, w_down
    assert report.row("expert weights").measured == experts / 4
    assert report.row("all-reduce over data").measured == experts / 4  # not over expert
    dense = report.row("all-reduce over data+expert")  # the rest, the loss, router stats
    assert dense.predicted == dense.measured
    flops = report.row("matmul flops")
    assert "N active: top-2 of 8 experts" in flops.how
    assert flops.ratio == pytest.approx(1, abs=0.1), report.text()


@pytest.mark.slow
@pytest.mark.parametrize("style", ["explicit", "gspmd"])
def test_dropless_expert_parallel_rows_count_the_rounds_in_the_program(style):
    config, report = moe_report(True, capacity_factor=None, style=style)
    layers, tokens = config.num_layers, MOE_ROWS // 8 * SEQ
    c = round_slots(tokens, 2, EXPERTS)
    a2a = report.row("all-to-all over expert")  # per round: 2 forward + 2 backward
    held = most_rounds(tokens, 2, EXPERTS)
    assert a2a.predicted == a2a.measured == 4 * layers * held * EXPERTS * c * EMBED * 4
    assert "a step runs ceil(busiest expert's choices / c)" in a2a.how
    dense = report.row("all-reduce over data+expert")  # router stats and the rounds' max
    if style == "explicit":  # under GSPMD, XLA's partitioner schedules the gradients' sums
        assert dense.predicted == dense.measured
    else:
        assert "XLA's partitioner schedules these" in dense.reason


@pytest.mark.slow
def test_moe_without_an_expert_axis_is_noted_as_replicated():
    _, report = moe_report(False)
    assert report.facts["note"] == (
        "MoE without an expert axis: all 8 experts are replicated on each of the 8 devices "
        "(no expert parallelism, no all-to-all); compose px.ExpertParallel('expert') with a "
        "mesh axis expert=N to split them")
    assert "note: MoE without an expert axis" in report.text()
    assert report.row("expert weights").how == "replicated: no expert axis"
    assert not [r for r in report.rows if r.name.startswith("all-to-all")]
    assert report.row("all-reduce over data").ratio == pytest.approx(1, abs=0.01)


def test_dropless_ragged_is_predicted_at_the_routed_tokens():
    """dropless_exchange='ragged' (what 'auto' picks on GPUs): 4 ragged all-to-alls per MoE
    layer of N k D at an even load, and the [n, E] counts gathered; no rounds."""
    from parallax.planner.predicted.expert_parallel import exchange_messages
    from parallax.planner.setting import read_setting
    moe = px.models.MoEConfig(num_experts=EXPERTS, top_k=2, capacity_factor=None)
    config = px.models.GPTConfig.tiny(embed_dim=EMBED, num_heads=2, mlp_dim=64,
                                      max_seq_len=SEQ, num_layers=2, moe=moe)
    strategy = px.compose(px.DataParallel("data"),
                          px.ExpertParallel("expert", dropless_exchange="ragged"))
    setting = read_setting(px.make_mesh(data=2, expert=4), strategy,
                           make_state("gpt", config),
                           {"tokens": jax.ShapeDtypeStruct((MOE_ROWS, SEQ + 1), jnp.int32)})
    found = {}
    exchange_messages(setting, lambda kind, axes, nbytes, n, how: found.update(
        {(kind, axes): (nbytes, n)}))
    tokens = MOE_ROWS // 8 * SEQ
    assert found[("ragged-all-to-all", ("expert",))] == (4 * 2 * tokens * 2 * EMBED * 4, 8)
    assert found[("all-gather", ("expert",))] == (2 * 4 * EXPERTS * 4, 2)
    assert ("all-to-all", ("expert",)) not in found
