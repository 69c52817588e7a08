import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import parallax as px
from parallax.analysis import hlo


@pytest.fixture(scope="module")
def mesh():
    return px.make_mesh(data=2, tensor=4)


def compile_(mesh, body, in_specs, out_specs, *args):
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs))
    return f.lower(*args).compile()


def test_kinds_bytes_and_axes(mesh):
    def body(x):
        s = lax.psum(x, "tensor")                                   # all-reduce over tensor
        g = lax.all_gather(x, "data", axis=0, tiled=True)           # all-gather over data
        r = lax.psum_scatter(g, "data", scatter_dimension=0, tiled=True)
        a = lax.all_to_all(x, "tensor", 0, 0, tiled=True)
        return s + r + a

    x = jnp.ones((16, 8), jnp.float32)  # local block: [8, 2]
    found = hlo.collectives(compile_(mesh, body, P("data", "tensor"), P("data", "tensor"), x), mesh)
    kinds = {c.kind: c for c in found}
    assert set(kinds) == {"all-reduce", "all-gather", "reduce-scatter", "all-to-all"}
    ar, ag, rs = kinds["all-reduce"], kinds["all-gather"], kinds["reduce-scatter"]
    assert ar.axes == ("tensor",) and ar.group_size == 4 and ar.message_bytes == 8 * 2 * 4
    assert ag.axes == ("data",) and ag.shapes == ((16, 2),) and ag.operand_bytes == 8 * 2 * 4
    assert ag.message_bytes == 16 * 2 * 4
    assert rs.axes == ("data",) and rs.result_bytes == 8 * 2 * 4 and rs.message_bytes == 16 * 2 * 4
    assert kinds["all-to-all"].axes == ("tensor",)
    assert all(c.count == 1 and not c.conditional for c in found)


def test_loop_trip_counts_multiply(mesh):
    def body(x):
        def step(c, _):
            return lax.ppermute(c, "tensor", [(i, (i + 1) % 4) for i in range(4)]), None
        x = lax.pcast(x, ("tensor",), to="varying")
        return lax.scan(step, x, None, length=3)[0]

    found = hlo.collectives(compile_(mesh, body, P(), P(None, "tensor"), jnp.ones((4, 4))), mesh)
    (perm,) = found
    assert perm.kind == "collective-permute" and perm.count == 3 and perm.axes == ("tensor",)
    assert len(perm.pairs) == 8
    assert hlo.count(found, "collective-permute", "tensor") == 3
    assert hlo.total_bytes(found, "collective-permute") == 3 * 4 * 4 * 4


def test_summary_table_and_text_input(mesh):
    def body(x):
        return lax.psum(x, ("data", "tensor"))

    compiled = compile_(mesh, body, P(("data", "tensor")), P(), jnp.ones((8, 4)))
    found = hlo.collectives(compiled.as_text(), mesh)
    assert found[0].axes == ("data", "tensor") and found[0].group_size == 8
    (row,) = hlo.summarize(found)
    assert (row.kind, row.count, row.message_bytes) == ("all-reduce", 1, 1 * 4 * 4)
    assert "all-reduce" in hlo.table(found) and "data,tensor" in hlo.table(found)


def test_without_a_mesh_axes_are_unknown(mesh):
    compiled = compile_(mesh, lambda x: lax.psum(x, "data"), P("data"), P(), jnp.ones((8, 4)))
    (c,) = hlo.collectives(compiled)
    assert c.axes is None and c.groups == ((0, 4), (1, 5), (2, 6), (3, 7))


def test_memory_analysis(mesh):
    f = jax.jit(lambda x: (x * 2).sum(0))
    mem = hlo.memory(f.lower(jnp.ones((256, 256))))
    assert mem.argument_bytes == 256 * 256 * 4 and mem.output_bytes == 256 * 4
    assert mem.peak_bytes >= mem.argument_bytes


def test_replica_group_formats():
    assert hlo._groups("replica_groups=[2,4]<=[8]", None) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert hlo._groups("replica_groups=[4,2]<=[2,4]T(1,0)", None) == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert hlo._groups("replica_groups={{0,2},{1,3}}", None) == ((0, 2), (1, 3))
    assert hlo._groups("replica_groups={}", 4) == ((0, 1, 2, 3),)
    # XLA 0.12 names the mesh and the axes the groups span
    named = "replica_groups=mesh['data'=4,'tensor'=2] {'data'}, use_global_device_ids=true"
    assert hlo._groups(named, 8) == ((0, 2, 4, 6), (1, 3, 5, 7))
    three = "replica_groups=mesh['data'=2,'fsdp'=2,'tensor'=2] {'data','fsdp'}"
    assert hlo._groups(three, 8) == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert hlo._groups("replica_groups=mesh['stage'=2,'data'=4] {'stage'}", 8) == (
        (0, 4), (1, 5), (2, 6), (3, 7))
