"""Each cross-device op equals the plain all-reduce and issues the collectives it names."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import parallax as px
from parallax.analysis import hlo

OPS = {
    "collective": px.tf.CollectiveAllReduce(),
    "collective-packed": px.tf.CollectiveAllReduce(bytes_per_pack=64),
    "nccl-ring": px.tf.NcclAllReduce(),
    "hierarchical": px.tf.HierarchicalCopyAllReduce(),
    "reduce-to-one": px.tf.ReductionToOneDevice(reduce_to_device=5),
}
SHAPES = {"odd": (13,), "matrix": (3, 5), "scalar": ()}  # 13 and 15 do not divide by 8


def _values(strategy, dtypes=(np.float32,)):
    def component(ctx):
        rng = np.random.default_rng(ctx.replica_id_in_sync_group)
        return {np.dtype(d).name: {k: rng.standard_normal(s).astype(d) for k, s in SHAPES.items()}
                for d in dtypes}
    return strategy.experimental_distribute_values_from_function(component)


def _reduce_both(values):
    ctx = px.tf.get_replica_context()
    return ctx.all_reduce(px.tf.ReduceOp.SUM, values), ctx.all_reduce("MEAN", values["float32"])


@pytest.mark.parametrize("name", OPS)
def test_op_equals_plain_all_reduce(name):
    strategy = px.tf.MirroredStrategy(cross_device_ops=OPS[name])
    plain = px.tf.MirroredStrategy()
    dtypes = (np.float32, jnp.bfloat16)
    total, mean = strategy.run(_reduce_both, args=(_values(strategy, dtypes),))
    ref_total, ref_mean = plain.run(_reduce_both, args=(_values(plain, dtypes),))
    exact = jax.tree.map(lambda v: np.sum(np.asarray(v.stacked, np.float64), 0),
                         _values(plain, dtypes), is_leaf=lambda x: isinstance(x, px.tf.PerReplica))
    cases = [(total["float32"], ref_total["float32"], exact["float32"], np.float32, 1e-6),
             (mean, ref_mean, exact["float32"], np.float32, 1e-6 / 8),
             # bf16 sums round differently in each algorithm: within n bf16 roundings
             (total["bfloat16"], ref_total["bfloat16"], exact["bfloat16"], jnp.bfloat16,
              8 * 2.0**-8)]
    for result, reference, exact_sum, dtype, rtol in cases:
        for key in SHAPES:
            components = np.asarray(result[key].stacked, np.float64)
            assert result[key].dtype == dtype
            assert (components == components[0]).all(), (name, key)  # the same everywhere
            want = np.asarray(reference[key].values[0], np.float64)
            bound = rtol * np.max(np.abs(exact_sum[key]))
            assert np.max(np.abs(components[0] - want)) <= bound, (name, dtype, key)


def _collectives(strategy, values):
    program = jax.jit(lambda v: strategy.run(
        lambda x: px.tf.get_replica_context().all_reduce("SUM", x), args=(v,)))
    # Without XLA's combiner, which would merge independent all-reduces into one tuple.
    compiled = program.lower(values).compile(
        compiler_options={"xla_disable_hlo_passes": "cpu-all-reduce-combiner"})
    return hlo.collectives(compiled, strategy.mesh)


def test_collectives_are_the_algorithms():
    n, total = 8, sum(int(np.prod(s)) for s in SHAPES.values())  # 29 floats per replica
    kinds = lambda found: sorted({c.kind for c in found})  # noqa: E731

    found = _collectives(px.tf.MirroredStrategy(), _values(px.tf.MirroredStrategy()))
    assert kinds(found) == ["all-reduce"] and len(found) == len(SHAPES)
    assert sum(c.message_bytes for c in found) == 4 * total

    ring = px.tf.MirroredStrategy(cross_device_ops=px.tf.NcclAllReduce())
    found = _collectives(ring, _values(ring))
    # one pack: ring reduce-scatter + ring all-gather, 2(n-1) messages of ceil(29/8) floats
    assert kinds(found) == ["collective-permute"] and len(found) == 2 * (n - 1)
    assert {c.message_bytes for c in found} == {4 * -(-total // n)}
    assert {c.pairs for c in found} == {tuple((i, (i + 1) % n) for i in range(n))}

    hier = px.tf.MirroredStrategy(cross_device_ops=px.tf.HierarchicalCopyAllReduce())
    found = _collectives(hier, _values(hier))
    assert [(c.kind, c.axes) for c in found] == [
        ("reduce-scatter", ("replica",)), ("all-reduce", ("group",)),
        ("all-gather", ("replica",))]

    one = px.tf.MirroredStrategy(cross_device_ops=px.tf.ReductionToOneDevice(5))
    found = _collectives(one, _values(one))
    permutes = [c for c in found if c.kind == "collective-permute"]
    into = [c for c in permutes if c.pairs[0][1] == 5]
    out = [c for c in permutes if c.pairs[0][0] == 5]
    # per leaf: n-1 whole buffers into device 5, n-1 chunks out of it, one all-gather
    assert len(into) == len(out) == len(SHAPES) * (n - 1)
    assert len(permutes) == 2 * len(SHAPES) * (n - 1)
    assert all(len(c.pairs) == 1 for c in permutes)
    assert sum(c.message_bytes for c in into) == (n - 1) * 4 * total
    assert kinds(found) == ["all-gather", "collective-permute"]


def test_hierarchical_mesh_and_packs():
    strategy = px.tf.MirroredStrategy(
        cross_device_ops=px.tf.HierarchicalCopyAllReduce(num_packs=0, group_size=2))
    assert strategy.replica_axes == ("group", "replica") and strategy.mesh.axis_sizes == (4, 2)
    found = _collectives(strategy, _values(strategy))
    assert sum(c.kind == "all-reduce" for c in found) == len(SHAPES)  # num_packs=0: per leaf
    with pytest.raises(ValueError, match=r"px.tf.HierarchicalCopyAllReduce: group_size=3 "
                                         r"does not divide the 8 replicas"):
        px.tf.MirroredStrategy(cross_device_ops=px.tf.HierarchicalCopyAllReduce(group_size=3))
    with pytest.raises(ValueError, match=r"px.tf.NcclAllReduce: num_packs=-1 must be an int"):
        px.tf.NcclAllReduce(num_packs=-1)
    with pytest.raises(ValueError, match=r"reduce_to_device=8 is not a replica index of the "
                                         r"8 replicas"):
        px.tf.MirroredStrategy(cross_device_ops=px.tf.ReductionToOneDevice(8))
    with pytest.raises(TypeError, match=r"px.tf.MirroredStrategy: cross_device_ops must be a "
                                        r"px.tf cross-device op"):
        px.tf.MirroredStrategy(cross_device_ops="nccl")
