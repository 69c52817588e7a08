"""Dropless MoE in rounds (parallax.nn.moe_dropless) on data=2 x expert=4: the rounds that run
follow the busiest expert; values and gradients equal one device's grouped matmuls; each
round is two all-to-alls of ``E c D`` elements forward and two backward, and its expert
matmuls are ``6 E c D F`` FLOPs forward, read from the compiled program."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import parallax as px
from parallax.analysis import hlo, program
from parallax.nn.moe import grouped_experts, swiglu_experts
from parallax.nn.moe_dropless import (dropless_in_rounds, most_rounds, positions,
                                      round_slots, rounds_needed)
from parallax.nn.moe_routing import Routing
from parallax.strategies.expert_dispatch import ExpertExchange

E, K, D, F, SEQ, ROWS = 8, 2, 16, 32, 16, 16  # per device: 2 sequences of 16 = 32 tokens
TOKENS = ROWS // 8 * SEQ


def test_rounds_count_the_busiest_expert():
    assert (round_slots(TOKENS, K, E), most_rounds(TOKENS, K, E)) == (8, 4)
    even = jnp.arange(TOKENS * K).reshape(TOKENS, K) % E  # every expert 8 choices
    assert int(rounds_needed(even, E)) == 1
    skewed = jnp.stack([jnp.zeros(TOKENS, int), 1 + jnp.arange(TOKENS) % 7], -1)
    assert int(rounds_needed(skewed, E)) == 4  # expert 0 has all 32 tokens
    assert positions(jnp.array([[0, 1], [1, 2], [0, 1]]), 3).tolist() == [[0, 0], [1, 0],
                                                                            [1, 2]]


def choices(kind, rng):
    """``[ROWS, SEQ, K]`` experts: even, random, or one device's tokens all on expert 0."""
    if kind == "even":
        flat = np.arange(ROWS * SEQ * K) % E
        return flat.reshape(ROWS, SEQ, K)
    first = rng.integers(0, E, (ROWS, SEQ))
    if kind == "skewed":
        first[:2] = 0
    second = (first + rng.integers(1, E, (ROWS, SEQ))) % E
    return np.stack([first, second], -1)


def setup(kind):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((ROWS, SEQ, D)).astype(np.float32)
    experts = jnp.asarray(choices(kind, rng), jnp.int32)
    gates = jax.nn.softmax(jnp.asarray(rng.standard_normal((ROWS, SEQ, K)), jnp.float32))
    weights = [0.2 * rng.standard_normal(s).astype(np.float32)
               for s in ((E, D, F), (E, D, F), (E, F, D))]
    return x, experts, gates, weights


def in_rounds(mesh):
    exchange = ExpertExchange("expert")
    batch, expert = jax.P(("data", "expert")), jax.P("expert")

    def local(x, experts, gates, *weights):
        run = lambda t: swiglu_experts(t, *weights)  # noqa: E731
        y, rounds = dropless_in_rounds(x, experts, gates, run, exchange.exchange, "expert", E,
                                       agree=("data",))
        return y, rounds[None]

    return differentiated(local, mesh, batch, expert)


def differentiated(local, mesh, batch, expert):
    """``local(x, experts, gates, *weights) -> (y, counts)`` in a shard_map (tokens split by
    ``batch``, weights by ``expert``), as ``(x, weights, experts, gates) -> ((loss, (y,
    counts)), (dx, dweights))`` with the loss ``sum(sin(y))``, jitted."""
    f = jax.shard_map(local, mesh=mesh, in_specs=(batch, batch, batch) + (expert,) * 3,
                      out_specs=(batch, batch))

    def loss(x, weights, experts, gates):
        y, counts = f(x, experts, gates, *weights)
        return jnp.sum(jnp.sin(y)), (y, counts)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def one_device(x, weights, experts, gates):
    routing = Routing(None, experts, gates)
    y = grouped_experts(x, routing, weights)
    return jnp.sum(jnp.sin(y)), y


@pytest.mark.parametrize("kind, rounds", [("even", 1), ("random", 2), ("skewed", 4)])
def test_values_and_gradients_equal_one_device(kind, rounds):
    mesh = px.make_mesh(data=2, expert=4)
    x, experts, gates, weights = setup(kind)
    (value, (y, ran)), grads = in_rounds(mesh)(x, weights, experts, gates)
    (ref, y_ref), ref_grads = jax.jit(jax.value_and_grad(one_device, argnums=(0, 1),
                                                         has_aux=True))(x, weights, experts,
                                                                        gates)
    # Device d holds rows 2 d and 2 d + 1; every device runs the busiest device's rounds.
    needed = [int(rounds_needed(experts[2 * d:2 * d + 2].reshape(-1, K), E)) for d in range(8)]
    assert np.asarray(ran).tolist() == [max(needed)] * 8 == [rounds] * 8
    assert px.testing.relative_difference(y, y_ref) <= 1e-5
    assert px.testing.relative_difference(grads, ref_grads) <= 1e-5
    assert abs(float(value) - float(ref)) <= 1e-5 * abs(float(ref))


def test_compiled_round_bytes_and_flops_follow_the_formula():
    mesh = px.make_mesh(data=2, expert=4)
    x, experts, gates, weights = setup("random")
    compiled = in_rounds(mesh).lower(x, weights, experts, gates).compile()
    found = [c for c in hlo.collectives(compiled, mesh) if c.kind == "all-to-all"]
    tokens = ROWS * SEQ // mesh.size
    c, most = round_slots(tokens, K, E), most_rounds(tokens, K, E)
    # Two all-to-alls forward and two backward, each in a round's branch, E c D per device.
    assert len(found) == 4 and all(c_.conditional and c_.count == most for c_ in found)
    assert {c_.message_bytes for c_ in found} == {E * c * D * 4}
    assert all(c_.axes == ("expert",) for c_ in found)
    ran = 2  # rounds of this routing on the busiest data shard (the test above)

    def shares(op_name, branches):
        if "dropless_round" not in op_name or branches != 2:
            return None
        return [1 - ran / most, ran / most]  # branch 1 runs the round

    totals = program.collective_totals(compiled, mesh, shares)
    assert totals[("all-to-all", ("expert",))] == (4 * ran, 4 * ran * E * c * D * 4)
    # Expert matmuls: forward 6 E c D F per round (gate and up stacked, then down); the
    # backward twice that; the rest of the program has no matmul.
    assert program.matmul_flops(compiled, shares) == 3 * ran * 6 * E * c * D * F
    padded = 3 * 6 * (ROWS // mesh.size) * E * SEQ * D * F  # [G, E, C = S, D] slots
    assert math.isclose(padded / (3 * 6 * E * c * D * F), E / K)
