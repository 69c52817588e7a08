"""The SPMD pipeline runtime: every schedule equals the sequential model and runs its table."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parallax import pipeline as pp
from parallax.pipeline.runtime.gradients import pipeline_grads
from parallax.pipeline.runtime.lowering import lower_schedule, widen
from parallax.pipeline.runtime.settings import PipelineSettings
from parallax.testing import relative_difference

from ..runtime_testing import (D, TOY, compiled, family, guard_dots, pipelined, reference,
                               stage_mesh, toy_batch, toy_params)

# Schedules of one shape share one compiled program (their tables are its arguments).
FAMILIES = {"one chunk": ("gpipe", "1f1b", "zb_h1", "zb_h2"),
            "looped": ("interleaved_1f1b", "interleaved_zb"),
            "V": ("zbv", "dualpipev")}
MATRIX = [(kind, p, factor * p) for kind in FAMILIES for p in (2, 4) for factor in (1, 2, 4)]


def assert_matches_sequential(loss, grads, layers, rtol=1e-5):
    ref_loss, ref_grads = reference(layers)
    assert relative_difference(loss, ref_loss) <= rtol
    assert relative_difference(grads, ref_grads) <= rtol


@pytest.mark.slow
@pytest.mark.parametrize("kind,p,m", MATRIX, ids=[f"{k}-p{p}-m{m}" for k, p, m in MATRIX])
def test_every_schedule_equals_the_sequential_model(kind, p, m):
    names = tuple(n for n in FAMILIES[kind] if not (n == "dualpipev" and m < 2 * p))
    chunks = 2 if kind == "looped" else None
    for name, (loss, grads, codes, sched) in family(names, p, m, chunks).items():
        assert_matches_sequential(loss, grads, p * sched.virtual_stages)
        # What ran is the table: each stage ran exactly the table's action every tick (the
        # trip counts of its guarded loops; a backward the schedule does not split ran its
        # W, and W's tick idled), and idled in the ticks that pad the program to its
        # family's longest table.
        np.testing.assert_array_equal(codes[: sched.ticks], ran(sched), name)
        assert not codes[sched.ticks:].any()


def ran(sched):
    """What the runtime runs for ``sched``, tick by tick: the table's kinds, with each B of
    a schedule that does not split the backward running its W (code 4, ``BW``) and the
    W's own tick idle."""
    kind = sched.as_arrays().kind
    if sched.split_backward:
        return kind
    return np.where(kind == 2, 4, np.where(kind == 3, 0, kind))


def test_an_unsplit_backward_runs_its_w_in_its_b_tick():
    """1F1B and GPipe (published with one backward unit): every W's tick is the one right
    after its B (the schedule's rule), and the runtime runs it inside that B, so it keeps
    no use gradients and holds each stash slot one tick less."""
    for name in ("1f1b", "gpipe"):
        fused, split = pp.schedule(name, 4, 8), pp.schedule(name, 4, 8, split_backward=True)
        lowered = lower_schedule(fused)
        np.testing.assert_array_equal(lowered.kind, ran(fused))
        assert lowered.kinds == {"F", "BW"} and lower_schedule(split).kinds == {"F", "B", "W"}
        assert lowered.capacity["uses"] == 0 < lower_schedule(split).capacity["uses"]


@pytest.mark.parametrize("name,p,m", [("1f1b", 4, 8), ("interleaved_1f1b", 2, 4)])
def test_split_backward_schedules_and_chunks_of_several_layers(name, p, m):
    v = 2 if name.startswith("interleaved") else 1
    loss, grads, codes, sched = pipelined(name, p, m, v, split_backward=True, per_chunk=2)
    assert_matches_sequential(loss, grads, 2 * p * v)
    np.testing.assert_array_equal(codes, ran(sched))


def test_a_custom_schedule_runs_as_drawn():
    # Zero-bubble style (ZB-H1 shape): stage 0 defers its weight gradients into the bubble.
    sched = pp.Schedule.from_orders(
        ["F0 F1 B0 B1 W0 W1", "F0 B0 W0 F1 B1 W1"], split_backward=True, name="zb")
    params, batch = toy_params(2), toy_batch()

    def run(params, batch):
        return pipeline_grads(TOY, params, lambda p: p, batch,
                              PipelineSettings.of("test", microbatches=2, schedule=sched,
                                                  remat="never"), trace=True)

    with jax.set_mesh(stage_mesh(2)):
        loss, grads, codes = jax.jit(run)(params, batch)
    assert_matches_sequential(loss, grads, 2)
    np.testing.assert_array_equal(np.asarray(codes), sched.as_arrays().kind)


@pytest.mark.slow
def test_each_action_computes_only_its_part():
    """From the compiled program: the tick loop holds one guarded loop per kind of action,
    a backward holds no weight-gradient matmul, the weight action no input-gradient one,
    a backward the schedule does not split holds both once, and the tick computes nothing
    outside its actions."""
    params, batch = toy_params(2), toy_batch()

    def dots(remat, **split):
        return guard_dots(compiled(pp.value_and_grad(TOY, "1f1b", microbatches=4, remat=remat,
                                                     **split), 2, params, batch))

    # F: the layer, first (x @ w_in) and last with its gradient (3 dots). B: the layer's
    # input gradient and first's weight gradient. W: the layer's weight gradient. A B that
    # also computed the weight gradient would count 3.
    assert dots("never", split_backward=True) == [{"outside": 0, "F": [5], "B": [2], "W": [1]}]
    # B recomputes the forward, once
    assert dots("always", split_backward=True) == [{"outside": 0, "F": [5], "B": [3], "W": [1]}]
    # 1F1B as published: one backward (BW) computes B's and W's matmuls, once each
    assert dots("never") == [{"outside": 0, "F": [5], "BW": [3]}]
    assert dots("always") == [{"outside": 0, "F": [5], "BW": [4]}]


@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_two_ppermutes_per_tick_and_nothing_else_in_the_loop(name):
    from parallax.analysis import hlo

    sched = pp.schedule(name, 4, 8)
    params, batch = toy_params(4 * sched.virtual_stages), toy_batch()
    program = compiled(pp.value_and_grad(TOY, sched), 4, params, batch)
    found = hlo.collectives(program, stage_mesh(4))
    permutes = [c for c in found if c.count > 1]
    assert [c.count for c in permutes] == [sched.ticks, sched.ticks]  # one pair per tick
    assert {c.pairs for c in permutes} == {((0, 1), (1, 2), (2, 3), (3, 0)),
                                          ((0, 3), (1, 0), (2, 1), (3, 2))}
    assert [c.kind for c in permutes] == ["collective-permute"] * 2
    # never inside an action's guarded loop, which only some stages run (a deadlock on CPU)
    assert all(not c.conditional and not re.search(r"pp_[FBW]/", c.op_name) for c in found)


def test_two_stages_need_one_ppermute_per_tick():
    from parallax.analysis import hlo

    sched = pp.schedule("1f1b", 2, 4)
    program = compiled(pp.value_and_grad(TOY, sched), 2, toy_params(2), toy_batch())
    loop = [c for c in hlo.collectives(program, stage_mesh(2)) if c.count > 1]
    assert [(c.kind, c.count, c.pairs) for c in loop] == [
        ("collective-permute", sched.ticks, ((0, 1), (1, 0)))]
    assert all("parallax/pipeline_send" in c.op_name for c in loop)  # named in profiles
    assert not re.search(r"pp_[FBW]/", loop[0].op_name)


@pytest.mark.parametrize("remat", ["never", "always", "except_last", "dots_saveable"])
def test_remat_options_give_the_same_gradients(remat):
    loss, grads, _, _ = pipelined("1f1b", 2, 4, remat=remat, per_chunk=2)
    assert_matches_sequential(loss, grads, 4)


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["never", "always"])
def test_gpipe_by_autodiff_agrees_with_the_table_runtime(remat):
    params, batch = toy_params(4), toy_batch()
    with jax.set_mesh(stage_mesh(2)):
        auto = jax.jit(pp.gpipe_value_and_grad(TOY, microbatches=4, remat=remat))(params, batch)
    table, grads, _, _ = pipelined("gpipe", 2, 4, remat=remat, per_chunk=2)
    assert relative_difference(auto[0], table) <= 1e-6
    assert relative_difference(auto[1], grads) <= 1e-6
    assert_matches_sequential(*auto, 4)


@pytest.mark.slow
def test_nnx_modules_and_pytree_activations():
    from flax import nnx

    class Layer(nnx.Module):
        def __init__(self, w):
            self.w = nnx.Param(jnp.asarray(w))

    class Model(nnx.Module):  # the stacked layers: one Layer whose param has a layer axis
        def __init__(self, rng):
            self.scale = nnx.Param(jnp.full((4,), 0.5, jnp.float32))
            self.layers = Layer(rng.standard_normal((4, 4, 4), np.float32) / 4)

    loss = pp.Stages(  # x is a pair (hidden, skip): activations may be pytrees
        first=lambda m, b: (b["x"] * m.scale[...], b["x"]),
        stage=lambda layer, x: (jnp.tanh(x[0] @ layer.w[...]) + x[1], x[1]),
        last=lambda m, x, b: jnp.mean((x[0] * m.scale[...]) ** 2),
        layers=lambda m: m.layers,
    )
    rng = np.random.default_rng(0)
    model, batch = Model(rng), {"x": rng.standard_normal((8, 4), np.float32)}
    ref_loss, ref_grads = nnx.value_and_grad(loss)(model, batch)
    with jax.set_mesh(stage_mesh(2)):
        value, grads = jax.jit(pp.value_and_grad(loss, "interleaved_1f1b", microbatches=2,
                                                 virtual_stages=2))(model, batch)
    assert isinstance(grads, nnx.State)
    assert relative_difference(value, ref_loss) <= 1e-6
    assert relative_difference(grads, ref_grads) <= 1e-6


# -- the lowered schedule and the interleaved layer order ----------------------------------


@pytest.mark.parametrize("sched", [pp.schedule("gpipe", 3, 5), pp.schedule("1f1b", 4, 8),
                                   pp.schedule("interleaved_1f1b", 2, 4, 2, True)], ids=repr)
def test_without_remat_the_stash_slots_are_the_schedules_stash(sched):
    """The runtime's stash is the schedule's: the same slots where the backward is split;
    where it is not, each B runs its W and frees its slot a tick earlier, so every slot is
    held from F to B and the runtime needs no more slots than the schedule."""
    lowered, arrays = lower_schedule(sched, "never"), sched.as_arrays()
    assert lowered.capacity["inputs"] == 0
    if sched.split_backward:
        active = arrays.kind > 0
        np.testing.assert_array_equal(lowered.slots["stash"][active], arrays.stash[active])
        assert lowered.capacity["stash"] == arrays.stash_capacity.max()
        return
    assert lowered.capacity["stash"] <= arrays.stash_capacity.max()
    held = {}  # (stage, chunk, micro-batch) -> the slot its F wrote
    for t, s in zip(*np.nonzero(lowered.kind)):
        key = (s, lowered.chunk[t, s], lowered.microbatch[t, s])
        if lowered.kind[t, s] == 1:
            slot = lowered.slots["stash"][t, s]
            assert key not in held and 0 <= slot < lowered.capacity["stash"]
            assert lowered.slots["stash"][t, s] not in {v for k, v in held.items() if k[0] == s}
            held[key] = lowered.slots["stash"][t, s]
        else:  # BW: reads the slot its F wrote, and frees it
            assert lowered.slots["stash"][t, s] == held.pop(key)
    assert not held


def test_remat_moves_the_stash_into_the_input_ring():
    sched = pp.schedule("gpipe", 2, 4)
    caps = {r: lower_schedule(sched, r).capacity for r in ("never", "except_last", "always")}
    assert [caps[r]["stash"] for r in caps] == [4, 2, 1]
    assert [caps[r]["inputs"] for r in caps] == [0, 3, 4]
    assert {c["uses"] for c in caps.values()} == {0}  # W runs inside its B: nothing kept
    split = pp.schedule("gpipe", 2, 4, split_backward=True)
    assert lower_schedule(split, "always").capacity["uses"] >= 1  # B's use gradients for W


def test_zero_bubble_schedules_keep_use_gradients_until_their_w():
    # ZB-H2 defers the last 2s weight gradients of stage s: their use gradients wait
    assert lower_schedule(pp.schedule("zb_h2", 4, 8)).capacity["uses"] == 7


def test_only_rings_an_executed_write_can_miss_keep_a_spare_row():
    # every ring is zeroed when the step starts: a spare row nobody writes is zeroed bytes
    sched = pp.schedule("gpipe", 4, 8)
    never, mixed = lower_schedule(sched), lower_schedule(sched, "except_last")
    assert never.spares == {"inbox"} and never.rows("stash") == never.capacity["stash"] == 8
    assert never.rows("uses") == never.rows("inputs") == 0  # no split, no rematerialisation
    # only some forwards rematerialised: each F writes its stash or its input, not both
    assert mixed.spares == {"inbox", "stash", "inputs"}
    assert mixed.rows("stash") == mixed.capacity["stash"] + 1
    assert lower_schedule(sched, "always").spares == {"inbox"}
    widened = widen([never, mixed])
    assert all(w.spares == mixed.spares for w in widened)
    # widened, tables that each remat all or none of their forwards mix them: F writes both
    widened = widen([never, lower_schedule(sched, "always")])
    assert all(w.spares == {"inbox", "stash", "inputs"} for w in widened)


@pytest.mark.parametrize("remat", ["never", "always"])
def test_the_tick_loop_copies_no_ring(remat):
    """Each action writes its rings in place, and so does each layer of its layer loop
    (``F`` and a rematerialised ``B`` write the stash at ``[slot, layer]``, ``B`` the use
    gradients): no ``copy`` in the program is as large as a ring, inside the tick loop or
    where the rings are made (each ring's zeros are its own, so XLA's common-subexpression
    pass does not merge them into one the loop then copies). A ``lax.switch`` returning a
    slot, or reading a ring written later in the tick, made XLA copy rings every tick."""
    from parallax.analysis import hlo

    sched = pp.schedule("1f1b", 4, 8)
    program = compiled(pp.value_and_grad(TOY, sched, remat=remat), 4, toy_params(8),
                       toy_batch())
    blocks = hlo.computations(program.as_text())

    def elements(line):
        dims = re.search(r"=\s*\w+\[([\d,]*)\]", line).group(1)
        return int(np.prod([int(d) for d in dims.split(",") if d]))

    lines = [line for body in blocks.values() for line in body]
    copies = [elements(line) for line in lines if re.search(r"\scopy\(", line)]
    # [slots, layers, rows, D]
    ring = lower_schedule(sched, remat).rows("stash") * 2 * 4 * D
    # the size is right: the program makes a buffer of exactly the ring's size
    assert any(elements(line) == ring for line in lines if re.search(r"=\s*f32\[", line))
    assert copies and max(copies) < ring
