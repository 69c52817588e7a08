"""px.ExpertParallel: one device's MoE GPT over 3 steps (whole state), without and with
dropped tokens; two all-to-alls per MoE layer forward and two backward, of the predicted
bytes; composition with FSDP, with tensor parallelism inside the experts, with pipelines (GPipe
with DP, 1F1B with EP); the GSPMD style; the refusals."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import parallax as px
from parallax.analysis import hlo

STEPS, ROWS, SEQ, EXPERTS, LAYERS, EMBED = 3, 16, 16, 8, 2, 32


def config(capacity_factor):
    moe = px.models.MoEConfig(num_experts=EXPERTS, top_k=2, capacity_factor=capacity_factor)
    return px.models.GPTConfig.tiny(embed_dim=EMBED, num_heads=2, mlp_dim=64, max_seq_len=SEQ,
                                    num_layers=LAYERS, moe=moe)


def make(cfg):
    return lambda: px.TrainState.create(px.models.GPT(cfg, rngs=nnx.Rngs(0)),
                                        optax.sgd(0.1, momentum=0.9))


def data():
    rng = np.random.default_rng(0)
    return [{"tokens": rng.integers(0, 256, (ROWS, SEQ + 1)).astype(np.int32)}
            for _ in range(STEPS)]


def one_device(cfg):
    """The plain program: jax.value_and_grad under jax.jit, no parallax in the loop."""
    state = make(cfg)()

    @jax.jit
    def step(state, batch):
        def loss(params):
            model = nnx.merge(state.graphdef, params, state.rest)
            return px.models.moe_next_token_loss(model, batch)

        (_, aux), grads = jax.value_and_grad(loss, has_aux=True)(state.params)
        return state.apply_gradients(grads), aux

    return state, step


def parallel(cfg, mesh, strategy):
    state = px.init(make(cfg), mesh, strategy)

    @px.train_step(mesh, strategy)
    def step(state, batch):
        (_, aux), grads = px.value_and_grad(px.models.moe_next_token_loss, has_aux=True)(
            state.model, batch)
        return state.apply_gradients(grads), aux

    return state, step


def trajectory(state, step):
    states, stats = [], []
    for batch in data():
        state, aux = step(state, batch)
        states.append(jax.device_get(jax.tree.leaves(state)))
        stats.append(jax.device_get(aux))
    return states, stats


def assert_same_trajectory(par, ref):
    for i, (p, r) in enumerate(zip(par[0], ref[0])):
        diff = px.testing.relative_difference(p, r)
        assert diff <= 1e-5, f"step {i + 1}: whole state differs by {diff:.2e}"
    for p, r in zip(par[1], ref[1]):
        assert px.testing.relative_difference(p, r) <= 1e-5


DP_EP = ({"data": 2, "expert": 4}, px.compose(px.DataParallel("data"),
                                                px.ExpertParallel("expert")))


@pytest.mark.slow
def test_no_drops_matches_one_device():
    cfg = config(capacity_factor=4.0)  # C = S: nothing can drop
    ref = trajectory(*one_device(cfg))
    par = trajectory(*parallel(cfg, px.make_mesh(**DP_EP[0]), DP_EP[1]))
    assert all(float(s["dropped_fraction"]) == 0.0 for s in ref[1])
    assert_same_trajectory(par, ref)


@pytest.mark.slow
def test_drops_match_one_device_and_two_all_to_alls_each_way():
    cfg = config(capacity_factor=0.5)
    ref = trajectory(*one_device(cfg))
    mesh = px.make_mesh(**DP_EP[0])
    state, step = parallel(cfg, mesh, DP_EP[1])
    found = [c for c in hlo.collectives(step.lower(state, data()[0]).compile(), mesh)
             if c.kind == "all-to-all"]
    par = trajectory(state, step)
    assert all(float(s["dropped_fraction"]) > 0.2 for s in ref[1])  # tokens did drop
    assert_same_trajectory(par, ref)  # the same ones: same losses, state, loads
    # One scanned MoE body: 2 all-to-alls forward, 2 backward (transposed), each run once
    # per layer, each moving this device's [G, E, C, D] slots.
    forward = [c for c in found if "transpose" not in c.op_name]
    assert (len(forward), len(found)) == (2, 4)
    assert all(c.axes == ("expert",) and c.count == LAYERS for c in found)
    rows = ROWS // mesh.size
    predicted = rows * EXPERTS * cfg.moe.capacity(SEQ) * EMBED * 4
    assert {c.message_bytes for c in found} == {predicted}
    assert hlo.count(found, "all-to-all") == 4 * LAYERS


@pytest.mark.slow
def test_gradients_summed_by_exchanges_match_one_device():
    """The experts' gradients and the rest summed by parallax.comm's tree exchanges (the
    default across CPU processes), each over the axes that replicate it."""
    cfg = config(capacity_factor=0.5)
    ref = trajectory(*one_device(cfg))
    strategy = px.compose(px.DataParallel("data", sync="tree"), px.ExpertParallel("expert"))
    assert_same_trajectory(trajectory(*parallel(cfg, px.make_mesh(**DP_EP[0]), strategy)), ref)


@pytest.mark.slow
def test_fsdp_with_expert_parallel_matches_one_device():
    cfg = config(capacity_factor=1.0)
    ref = trajectory(*one_device(cfg))
    strategy = px.compose(px.FSDP("fsdp"), px.ExpertParallel("expert"))
    par = trajectory(*parallel(cfg, px.make_mesh(fsdp=2, expert=4), strategy))
    assert_same_trajectory(par, ref)


@pytest.mark.slow
def test_tensor_parallel_inside_experts_matches_one_device():
    """data=2 x expert=2 x tensor=2: Megatron's split inside each expert, GShard's exchange."""
    cfg = config(capacity_factor=1.0)
    ref = trajectory(*one_device(cfg))
    mesh = px.make_mesh(data=2, expert=2, tensor=2)
    strategy = px.compose(px.DataParallel("data"), px.ExpertParallel("expert"),
                          px.TensorParallel("tensor"))
    state, step = parallel(cfg, mesh, strategy)
    experts = state.params["blocks"]["mlp"]
    assert experts["w_gate"].sharding.spec == jax.P(None, "expert", None, "tensor")
    assert experts["w_down"].sharding.spec == jax.P(None, "expert", "tensor")
    found = hlo.collectives(step.lower(state, data()[0]).compile(), mesh)
    par = trajectory(state, step)
    assert_same_trajectory(par, ref)
    in_layer = [c for c in found if not c.in_entry and c.count == LAYERS]
    exchange = [c for c in in_layer if c.kind == "all-to-all"]
    assert len(exchange) == 4 and all(c.axes == ("expert",) for c in exchange)
    rows = ROWS // (mesh.shape["data"] * mesh.shape["expert"])
    slots = rows * EXPERTS * cfg.moe.capacity(SEQ) * EMBED * 4  # [G, E, C, D] float32
    residual = rows * SEQ * EMBED * 4  # [B, T, D] float32
    tensor = [c for c in in_layer if c.axes == ("tensor",)]
    assert all(c.kind == "all-reduce" for c in tensor)
    forward = sorted(c.message_bytes for c in tensor if "transpose" not in c.op_name)
    backward = sorted(c.message_bytes for c in tensor if "transpose" in c.op_name)
    # Per layer, forward: attention's row-parallel output and the experts' w_down output
    # (before the return all-to-all); backward: the input gradients of attention's fused
    # q/k/v and of the experts' fused gate/up projection. Megatron's two each way.
    assert forward == [residual, slots]
    assert backward == [residual, slots]


@pytest.mark.slow
def test_gspmd_style_constrains_the_slots_into_all_to_alls_and_matches_one_device():
    cfg = config(capacity_factor=0.5)
    ref = trajectory(*one_device(cfg))
    mesh = px.make_mesh(data=2, expert=4)
    strategy = px.compose(px.DataParallel("data"), px.ExpertParallel("expert", style="gspmd"))
    state, step = parallel(cfg, mesh, strategy)
    found = hlo.collectives(step.lower(state, data()[0]).compile(), mesh)
    assert_same_trajectory(trajectory(state, step), ref)
    exchange = [c for c in found if c.kind == "all-to-all"]
    assert len([c for c in exchange if "transpose" not in c.op_name]) == 2
    assert len(exchange) == 4 and all(c.axes == ("expert",) and c.count == LAYERS
                                      for c in exchange)
    rows = ROWS // mesh.size
    assert {c.message_bytes for c in exchange} == {
        rows * EXPERTS * cfg.moe.capacity(SEQ) * EMBED * 4}
    # XLA CPU also all-gathers the router logits [B, S, E] before top_k (it does not
    # partition top_k over the batch here): small, and pinned so a change is seen.
    gathers = [c for c in found if c.kind == "all-gather"]
    assert [(c.axes, c.message_bytes) for c in gathers] == [
        (("data", "expert"), ROWS * SEQ * EXPERTS * 4)]


MICRO, CHUNKS = 2, 4  # micro-batches per batch shard; batch shards x micro-batches


def one_device_per_microbatch(cfg):
    """One device's loss as a pipeline over 2 batch shards computes it: the mean over the 4
    (shard, micro-batch) row blocks of each block's MoE loss (router losses per block)."""
    from parallax.models.gpt_pipeline import next_token_stages
    state = make(cfg)()

    @jax.jit
    def step(state, batch):
        def loss(params):
            model = nnx.merge(state.graphdef, params, state.rest)
            blocks = batch["tokens"].reshape(CHUNKS, -1, SEQ + 1)
            return sum(next_token_stages(model, {"tokens": b}) for b in blocks) / CHUNKS

        value, grads = jax.value_and_grad(loss)(state.params)
        return state.apply_gradients(grads), value

    return state, step


@pytest.mark.slow
@pytest.mark.parametrize("schedule, batch_axis", [("gpipe", "data"), ("1f1b", "expert")])
def test_pipeline_matches_one_device(schedule, batch_axis):
    from parallax.models.gpt_pipeline import next_token_stages
    cfg = config(capacity_factor=1.0)
    mesh = px.make_mesh(stage=2, **{batch_axis: 2}, devices=jax.devices()[:4])
    split = (px.DataParallel("data") if batch_axis == "data"
             else px.ExpertParallel("expert"))
    strategy = px.compose(split, px.Pipeline("stage", microbatches=MICRO, schedule=schedule))
    state = px.init(make(cfg), mesh, strategy)

    @px.train_step(mesh, strategy)
    def step(state, batch):
        value, grads = px.value_and_grad(next_token_stages)(state.model, batch)
        return state.apply_gradients(grads), value

    if batch_axis == "expert":  # the experts split over expert inside the stages
        assert state.params["blocks"]["mlp"]["w_up"].sharding.spec[:2] == ("stage", "expert")
        found = hlo.collectives(step.lower(state, data()[0]).compile(), mesh)
        assert {c.axes for c in found if c.kind == "all-to-all"} == {("expert",)}
    assert_same_trajectory(trajectory(state, step), trajectory(*one_device_per_microbatch(cfg)))


def test_experts_not_divisible_by_the_axis_are_refused():
    cfg = px.models.GPTConfig.tiny(moe=px.models.MoEConfig(num_experts=6))
    with pytest.raises(ValueError, match=r"px.init: px.ExpertParallel\('expert'\) splits the "
                       r"experts of parameter .*w_(gate|up|down).* 6 experts on dimension 1.* mesh axis "
                       r"expert=4 .* 4 does not divide 6; use a number of experts that is a "
                       r"multiple of 4 \(MoEConfig\(num_experts=8\)\)"):
        px.init(make(cfg), px.make_mesh(data=2, expert=4), DP_EP[1])


@pytest.mark.slow
def test_moe_without_an_expert_axis_runs_replicated_and_says_so():
    cfg = config(capacity_factor=4.0)
    mesh = px.make_mesh(data=8)
    state, step = parallel(cfg, mesh, px.DataParallel("data"))
    with pytest.warns(UserWarning, match=r"parallax.nn.MoE: the strategy DataParallel\('data'\) "
                      r"has no expert axis, so all 8 experts are replicated on each of the 8 "
                      r"devices .* compose px.ExpertParallel\('expert'\)"):
        step(state, data()[0])


def test_compose_refuses_two_expert_axes_and_a_clash():
    with pytest.raises(ValueError, match=r"px.compose: conflicting rules for logical axis "
                       r"'expert': ExpertParallel\('expert'\) maps it to 'expert' and "
                       r"ExpertParallel\('data'\) maps it to 'data'"):
        px.compose(px.ExpertParallel("expert"), px.ExpertParallel("data"))
    with pytest.raises(ValueError, match=r"px.compose: mesh axis 'expert' splits the batch"):
        px.compose(px.DataParallel("expert"), px.ExpertParallel("expert"))
    with pytest.raises(TypeError, match=r"px.ExpertParallel: axis must be a mesh axis name"):
        px.ExpertParallel(4)
