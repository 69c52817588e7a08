"""Dropless MoE with ragged all-to-alls (parallax.nn.moe_ragged) on data=2 x expert=4 and
expert=8, run on CPU through the emulated collective: values and gradients equal one device's
grouped matmuls for even, random and skewed routings; each device sends exactly its ``N k``
routed rows; and the real op's program, lowered for a GPU, holds ragged all-to-alls of the
routed tokens' shapes and no all-to-all of token data."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import parallax as px
from parallax.comm.ragged import emulated_ragged_all_to_all
from parallax.nn.moe import swiglu_grouped
from parallax.nn.moe_ragged import dropless_ragged, ragged_plan, receive_rows

from . import test_moe_dropless as md

E, K, D, F = md.E, md.K, md.D, md.F
LAYOUTS = {"data x expert": dict(data=2, expert=4), "expert": dict(expert=8)}


def ragged(mesh, collective=emulated_ragged_all_to_all):
    batch, expert = jax.P(tuple(mesh.axis_names)), jax.P("expert")

    def local(x, experts, gates, *weights):
        run = lambda rows, sizes: swiglu_grouped(rows, sizes, weights)  # noqa: E731
        y = dropless_ragged(x, experts, gates, run, "expert", E, collective)
        counts = jnp.bincount(experts.reshape(-1), length=E).astype(jnp.int32)
        sent = ragged_plan(jax.lax.all_gather(counts, "expert"),
                           jax.lax.axis_index("expert"), E // mesh.shape["expert"])
        return y, jnp.stack([sent["send_size"].sum(), sent["groups"].sum()])[None]

    return md.differentiated(local, mesh, batch, expert)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("kind", ["even", "random", "skewed"])
def test_values_and_gradients_equal_one_device(kind, layout):
    mesh = px.make_mesh(**LAYOUTS[layout])
    x, experts, gates, weights = md.setup(kind)
    (value, (y, sizes)), grads = ragged(mesh)(x, weights, experts, gates)
    (ref, y_ref), ref_grads = jax.jit(jax.value_and_grad(md.one_device, argnums=(0, 1),
                                                         has_aux=True))(x, weights, experts,
                                                                        gates)
    assert px.testing.relative_difference(y, y_ref) <= 1e-5
    assert px.testing.relative_difference(grads, ref_grads) <= 1e-5
    assert abs(float(value) - float(ref)) <= 1e-5 * abs(float(ref))
    # Each device sends exactly its N k choices (no rounding up to c slots per expert);
    # each receives its experts' share, within the static buffer.
    sizes = np.asarray(sizes)
    tokens = md.ROWS * md.SEQ // mesh.size
    n = mesh.shape["expert"]
    assert sizes[:, 0].tolist() == [tokens * K] * mesh.size
    per_group = sizes[:, 1].reshape(-1, n)  # [data shard, expert device]
    flat = np.asarray(experts).reshape(mesh.size // n, -1)  # each data shard's choices
    local = E // n
    want = [[int(np.sum(f // local == j)) for j in range(n)] for f in flat]
    assert per_group.tolist() == want
    assert per_group.max() <= receive_rows(tokens, K, E, n)


def test_gpu_program_holds_ragged_all_to_alls_of_the_routed_rows():
    """The real op, lowered for CUDA (XLA:CPU cannot compile it): forward dispatch and
    combine, and their two transposes; every other all-to-all moves int32 offsets only."""
    mesh = px.make_mesh(data=2, expert=4)
    x, experts, gates, weights = md.setup("random")
    text = (ragged(mesh, jax.lax.ragged_all_to_all).trace(x, weights, experts, gates)
            .lower(lowering_platforms=("cuda",)).as_text())
    lines = text.splitlines()
    calls = [re.search(r"\} : \((tensor<\w+>), (tensor<\w+>),", line).groups()
             for line in lines if "custom_call @ragged_all_to_all" in line]
    tokens, n = md.ROWS * md.SEQ // 8, 4
    routed = f"tensor<{tokens * K}x{D}xf32>"
    bound = f"tensor<{receive_rows(tokens, K, E, n)}x{D}xf32>"
    # dispatch: routed -> bound; combine: bound -> routed; the backward the same two, reversed
    assert sorted(calls) == sorted([(routed, bound), (bound, routed)] * 2)
    others = [re.search(r"\}> : \((tensor<\w+>)\)", line).group(1)
              for line in lines if '"stablehlo.all_to_all"' in line]
    assert others and set(others) == {f"tensor<{E}xi32>"}  # the transposes' offsets
    # The local experts: 3 ragged_dots forward on the receive buffer, grouped by the L local
    # experts ([M, D] x [L, D, F], [M, D] x [L, D, F], [M, F] x [L, F, D]), 6 backward. The
    # buffer bounds their FLOPs (2 M D F each); the useful ones are 2 R D F, R the rows
    # received (rows past the groups are zeros; whether XLA:GPU skips them is untested).
    dots = [re.search(r"\}> : \((tensor<\w+>), (tensor<\w+>), (tensor<\w+>)\)", line).groups()
            for line in lines if "chlo.ragged_dot" in line and "lhs_ragged" in line]
    local, rows = E // n, receive_rows(tokens, K, E, n)
    groups = f"tensor<{local}xi32>"
    forward = [(f"tensor<{rows}x{D}xf32>", f"tensor<{local}x{D}x{F}xf32>", groups)] * 2 + [
        (f"tensor<{rows}x{F}xf32>", f"tensor<{local}x{F}x{D}xf32>", groups)]
    assert len(dots) == 9 and all(d in dots for d in forward)
    assert {d[2] for d in dots} == {groups}
