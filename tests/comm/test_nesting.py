"""parallax.comm.nesting: the nested shard_map XLA 0.12 aborts on, reproduced without parallax
(in a subprocess: the abort kills the process), and what parallax does about it."""

import os
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest

import parallax as px
from parallax.comm import nesting
from tests.distributed.launching import Started

# stage (first in the mesh) manual inside data, tensor left automatic: nothing else
REPRO = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp
    from jax import P, shard_map
    jax.config.update("jax_num_cpu_devices", 8)
    names = tuple(sys.argv[1].split(","))
    auto = (jax.sharding.AxisType.Auto,) * 3
    mesh = jax.make_mesh((2, 2, 2), names, axis_types=auto)
    inner = lambda x: shard_map(lambda v: v * 3, in_specs=P("stage"), out_specs=P("stage"),
                                axis_names={"stage"})(x)
    f = jax.jit(shard_map(inner, mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                          axis_names={"data"}))
    with jax.set_mesh(mesh):
        print(float(f(jnp.ones((8, 8))).sum()))
""")


def run_repro(names: str):
    return Started([sys.executable, "-c", REPRO, names], timeout=300, cwd=None,
                   env=dict(os.environ)).finish()


# The versions whose XLA aborts on it: seen with jax 0.12.0.1; 0.10.2 and 0.12.1 compile it
# (parallax's check, nesting.ABORTS, still covers every 0.12: see parallax/comm/nesting.py).
SHOWS_ABORT = (0, 12) <= jax.__version_info__[:3] < (0, 12, 1)


def test_xla_on_stage_manual_inside_data_with_tensor_automatic():
    bad = run_repro("stage,data,tensor")
    if SHOWS_ABORT:
        assert bad.returncode != 0 and "Manual axes must be sorted" in bad.stderr, \
            bad.stderr[-2000:]
    else:
        assert bad.returncode == 0 and bad.stdout.strip() == "192.0", bad.stderr[-2000:]
    good = run_repro("data,stage,tensor")  # the same nesting, in the mesh's order
    assert good.returncode == 0 and good.stdout.strip() == "192.0", good.stderr[-2000:]


def stage_first_mesh():
    """A mesh built by hand with stage first (px.make_mesh names it after data)."""
    mesh = px.make_mesh(stage=2, data=2, tensor=2)
    assert mesh.axis_names == ("data", "stage", "tensor")
    return jax.sharding.Mesh(mesh.devices.transpose(1, 0, 2), ("stage", "data", "tensor"),
                             axis_types=(jax.sharding.AxisType.Auto,) * 3)


@pytest.mark.parametrize("stage_first", [True, False])
def test_the_nesting_is_found_and_widened_where_it_would_abort(stage_first):
    mesh = stage_first_mesh() if stage_first else px.make_mesh(stage=2, data=2, tensor=2)
    seen = {}

    def body(x):
        seen["order"] = nesting.out_of_order({"stage"})
        seen["widened"] = nesting.widened({"stage"})
        return x

    with jax.set_mesh(mesh):
        jax.jit(jax.shard_map(body, in_specs=jax.P("data"), out_specs=jax.P("data"),
                              axis_names={"data"}))(jnp.ones(8))
    if nesting.ABORTS and stage_first:
        assert seen == {"order": (("data",), ("tensor",)),
                        "widened": frozenset({"stage", "tensor"})}
    else:
        assert seen == {"order": ((), ()), "widened": frozenset({"stage"})}
    assert nesting.out_of_order({"stage"}) == ((), ())  # outside any shard_map
