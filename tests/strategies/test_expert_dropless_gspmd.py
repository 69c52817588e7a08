"""Dropless expert parallelism in the GSPMD style: the layer's exchange runs in a
``shard_map`` over the batch axes (rounds on CPU, ragged through the emulated collective), so
the all-to-alls move one round's ``E c D`` slots or the routed rows instead of ``C = S``
padded slots; px.models' MoE GPT and stock layers around ``px.nn.MoE`` equal one device
(whole state after each of 3 steps, router statistics) under data=2 x expert=4."""

import dataclasses
import re

import pytest
import test_expert as te
import test_expert_dropless as tdl

import parallax as px
from parallax.analysis import hlo
from parallax.comm.ragged import emulated_ragged_all_to_all
from parallax.nn.moe_dropless import most_rounds, round_slots
from parallax.nn.moe_ragged import receive_rows

EXCHANGES = ("rounds", "ragged")


def gspmd(exchange):
    ep = px.ExpertParallel("expert", style="gspmd", dropless_exchange=exchange)
    if exchange == "ragged":
        ep = dataclasses.replace(ep, experts=dataclasses.replace(
            ep.experts, ragged_collective=emulated_ragged_all_to_all))
    return px.make_mesh(data=2, expert=4), px.compose(px.DataParallel("data"), ep)


@pytest.mark.slow
@pytest.mark.parametrize("exchange", EXCHANGES)
def test_moe_gpt_matches_one_device(exchange):
    cfg = te.config(capacity_factor=None)
    ref = te.trajectory(*te.one_device(cfg))
    mesh, strategy = gspmd(exchange)
    state, step = te.parallel(cfg, mesh, strategy)
    te.assert_same_trajectory(te.trajectory(state, step), ref)
    if exchange == "rounds":  # one round's slots per all-to-all, not the padded G E S D
        found = [c for c in hlo.collectives(step.lower(state, te.data()[0]).compile(), mesh)
                 if c.kind == "all-to-all"]
        tokens = te.ROWS // mesh.size * te.SEQ
        c = round_slots(tokens, 2, te.EXPERTS)
        assert len(found) == 4 and all(f.axes == ("expert",) and f.conditional for f in found)
        assert {f.count for f in found} == {te.LAYERS * most_rounds(tokens, 2, te.EXPERTS)}
        assert {f.message_bytes for f in found} == {te.EXPERTS * c * te.EMBED * 4}


@pytest.mark.slow
@pytest.mark.parametrize("exchange", EXCHANGES)
def test_stock_layers_around_moe_match_one_device(exchange):
    ref = tdl.stock_trajectory(tdl.stock_state(), tdl.one_device_step())
    tdl.assert_stock_layers_match(*gspmd(exchange), ref)


def test_gpu_lowered_gspmd_step_holds_ragged_all_to_alls_of_the_routed_rows():
    """With the real op (lowered for CUDA: XLA:CPU cannot compile it) the shard_map region
    holds the dispatch and combine and their transposes, of the explicit style's shapes."""
    cfg = te.config(capacity_factor=None)
    mesh = px.make_mesh(data=2, expert=4)
    strategy = px.compose(px.DataParallel("data"), px.ExpertParallel(
        "expert", style="gspmd", dropless_exchange="ragged"))
    state, step = te.parallel(cfg, mesh, strategy)
    with pytest.warns(UserWarning, match="XLA:CPU cannot run jax.lax.ragged_all_to_all"):
        text = step.lower(state, te.data()[0], platforms=("cuda",)).as_text()
    calls = [re.search(r"\} : \((tensor<\w+>), (tensor<\w+>),", line).groups()
             for line in text.splitlines() if "custom_call @ragged_all_to_all" in line]
    tokens = te.ROWS // mesh.size * te.SEQ
    routed = f"tensor<{tokens * 2}x{te.EMBED}xf32>"
    bound = f"tensor<{receive_rows(tokens, 2, te.EXPERTS, 4)}x{te.EMBED}xf32>"
    assert sorted(calls) == sorted([(routed, bound), (bound, routed)] * 2)
