"""Dropless expert parallelism with ragged all-to-alls (``dropless_exchange="ragged"``):
px.models' MoE GPT and stock Flax layers around ``px.nn.MoE`` equal one device (whole state
after each of 3 steps, router statistics) under expert=8 and data=2 x expert=4 (and composed
with tensor parallelism or ZeRO-3), run on CPU through the emulated collective; the real op's train step, lowered for CUDA, holds ragged
all-to-alls of the routed rows and no all-to-all of token slots; the knob's refusal and the
CPU warning are pinned."""

import dataclasses
import re

import jax
import pytest
import test_expert as te
import test_expert_dropless as tdl

import parallax as px
from parallax.comm.ragged import emulated_ragged_all_to_all
from parallax.nn.moe_ragged import receive_rows

LAYOUTS = {"expert": {"expert": 8}, "data x expert": {"data": 2, "expert": 4}}


def ragged(layout, collective=emulated_ragged_all_to_all):
    """The layout's strategy with the ragged exchange through ``collective`` (None: the real op)."""
    shape = LAYOUTS[layout]
    ep = px.ExpertParallel("expert", dropless_exchange="ragged")
    ep = dataclasses.replace(ep, experts=dataclasses.replace(ep.experts,
                                                             ragged_collective=collective))
    strategy = px.compose(px.DataParallel("data"), ep) if "data" in shape else ep
    return px.make_mesh(**shape), strategy


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_moe_gpt_matches_one_device(layout):
    cfg = te.config(capacity_factor=None)
    ref = te.trajectory(*te.one_device(cfg))
    mesh, strategy = ragged(layout)
    te.assert_same_trajectory(te.trajectory(*te.parallel(cfg, mesh, strategy)), ref)


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_stock_layers_around_moe_match_one_device(layout):
    ref = tdl.stock_trajectory(tdl.stock_state(), tdl.one_device_step())
    tdl.assert_stock_layers_match(*ragged(layout), ref)


def test_gpu_lowered_step_sends_the_routed_rows_only():
    cfg = te.config(capacity_factor=None)
    mesh, strategy = ragged("data x expert", None)  # the real op
    state, step = te.parallel(cfg, mesh, strategy)
    with pytest.warns(UserWarning, match=re.escape(
            "parallax.nn.MoE: px.ExpertParallel('expert', dropless_exchange='ragged') on a "
            "mesh of cpu devices: XLA:CPU cannot run jax.lax.ragged_all_to_all, so this step "
            "lowers for a GPU or TPU (step.lower(..., platforms=('cuda',))) but does not "
            "compile here; use dropless_exchange='auto' or 'rounds' to run on CPU.")):
        text = step.lower(state, te.data()[0], platforms=("cuda",)).as_text()
    lines = text.splitlines()
    calls = [re.search(r"\} : \((tensor<\w+>), (tensor<\w+>),", line).groups()
             for line in lines if "custom_call @ragged_all_to_all" in line]
    tokens = te.ROWS // mesh.size * te.SEQ
    routed = f"tensor<{tokens * 2}x{te.EMBED}xf32>"
    bound = f"tensor<{receive_rows(tokens, 2, te.EXPERTS, 4)}x{te.EMBED}xf32>"
    # The scanned block's body: dispatch and combine forward, their transposes backward.
    assert sorted(calls) == sorted([(routed, bound), (bound, routed)] * 2)
    others = {re.search(r"\}> : \((tensor<\w+>)\)", line).group(1)
              for line in lines if '"stablehlo.all_to_all"' in line}
    assert others == {f"tensor<{te.EXPERTS}xi32>"}  # the transposes' offsets, no slots


def test_auto_picks_rounds_on_cpu_and_bad_values_are_refused():
    mesh = px.make_mesh(expert=8)
    assert px.ExpertParallel("expert").experts.dropless_exchange(mesh) == "rounds"
    forced = px.ExpertParallel("expert", dropless_exchange="ragged").experts
    assert forced.dropless_exchange(mesh) == "ragged"
    auto = px.ExpertParallel("expert").experts
    assert [auto.resolve(p) for p in ("gpu", "tpu", "cpu")] == ["ragged", "ragged", "rounds"]
    rounds = px.ExpertParallel("expert", dropless_exchange="rounds").experts
    assert rounds.resolve("gpu") == "rounds"
    abstract = jax.sharding.AbstractMesh((8,), ("expert",), (jax.sharding.AxisType.Auto,))
    assert auto.dropless_exchange(abstract) == "rounds"  # the default backend's: CPU here
    with pytest.raises(ValueError, match=re.escape(
            "px.ExpertParallel: dropless_exchange='fast' must be one of ('auto', 'ragged', "
            "'rounds'): 'ragged' (jax.lax.ragged_all_to_all, GPU/TPU), 'rounds' (fixed-size "
            "all-to-alls, every backend) or 'auto' (ragged on GPU/TPU, rounds elsewhere); "
            "leave it out for 'auto'.")):
        px.ExpertParallel("expert", dropless_exchange="fast")


COMPOSED = {  # the mesh, and the strategy composed with ExpertParallel
    "tensor": ({"data": 2, "expert": 2, "tensor": 2},
               lambda ep: px.compose(px.DataParallel("data"), ep, px.TensorParallel("tensor"))),
    "fsdp": ({"fsdp": 2, "expert": 4}, lambda ep: px.compose(px.FSDP("fsdp"), ep)),
}


@pytest.mark.slow
@pytest.mark.parametrize("with_, style, exchange", [
    ("tensor", None, "rounds"), ("tensor", None, "ragged"), ("tensor", "gspmd", "ragged"),
    ("fsdp", None, "ragged"), ("fsdp", "gspmd", "rounds")])
def test_composed_with_tensor_or_fsdp_matches_one_device(with_, style, exchange):
    """Megatron's split inside each expert (data=2 x expert=2 x tensor=2, the tensor axis
    automatic inside the exchange), or ZeRO-3 (fsdp=2 x expert=4): the dropless exchanges
    equal one device."""
    cfg = te.config(capacity_factor=None)
    ref = te.trajectory(*te.one_device(cfg))
    ep = px.ExpertParallel("expert", style=style, dropless_exchange=exchange)
    if exchange == "ragged":
        ep = dataclasses.replace(ep, experts=dataclasses.replace(
            ep.experts, ragged_collective=emulated_ragged_all_to_all))
    shape, compose = COMPOSED[with_]
    mesh = px.make_mesh(**shape)
    te.assert_same_trajectory(te.trajectory(*te.parallel(cfg, mesh, compose(ep))), ref)
