"""Bad input fails at trace time with a message naming the API, the value, what exists and
a fix. The messages are pinned here."""

import jax
import jax.numpy as jnp
import pytest

from .comm_testing import grid_mesh
from parallax import comm

P = jax.P


def trace(body, x=None, mesh=None):
    """Traces body inside shard_map over a data x tensor mesh (no compilation)."""
    mesh = grid_mesh() if mesh is None else mesh
    x = jnp.ones((8, 8)) if x is None else x
    jax.eval_shape(jax.shard_map(body, mesh=mesh, in_specs=P(("data", "tensor")),
                                 out_specs=P(("data", "tensor")), check_vma=False), x)


def test_unknown_axis_names_the_axes_available():
    with pytest.raises(ValueError, match=r"all_reduce: axis 'dat' is not a mesh axis here; the "
                       r"mesh axes available are 'data' \(size 2\), 'tensor' \(size 4\)\. "
                       r"Fix: pass one of \('data', 'tensor'\)"):
        trace(lambda v: comm.all_reduce(v, "dat"))
    with pytest.raises(ValueError, match=r"ring_all_reduce: axis 'stage' is not a mesh axis"):
        trace(lambda v: comm.ring_all_reduce(v, ("data", "stage")))


def test_outside_shard_map_says_where_to_call():
    with pytest.raises(ValueError, match=r"all_gather: axis 'data' is not a mesh axis here; "
                       r"the mesh axes available are none \(not inside jax.shard_map\)\. Fix: "
                       r"call all_gather inside jax.shard_map"):
        comm.all_gather(jnp.ones(3), "data")


def test_axis_must_be_a_name():
    with pytest.raises(TypeError, match=r"shift: axis=0 must be a mesh axis name"):
        trace(lambda v: comm.shift(v, 0))
    with pytest.raises(ValueError, match=r"names an axis twice"):
        trace(lambda v: comm.all_reduce(v, ("data", "data")))


def test_roots_ops_algorithms():
    with pytest.raises(ValueError, match=r"broadcast: root=4 is out of range for axis 'tensor' "
                       r"of size 4; use 0 <= root < 4\."):
        trace(lambda v: comm.broadcast(v, "tensor", root=4))
    with pytest.raises(TypeError, match=r"reduce: root=1.0 must be a Python int"):
        trace(lambda v: comm.reduce(v, "tensor", root=1.0))
    with pytest.raises(ValueError, match=r"all_reduce: op='avg' is not supported; use one of "
                       r"'sum', 'mean', 'max', 'min', 'prod'\."):
        trace(lambda v: comm.all_reduce(v, "data", "avg"))
    with pytest.raises(ValueError, match=r"reduce_scatter: op='max' is not supported; use one "
                       r"of 'sum', 'mean'\."):
        trace(lambda v: comm.reduce_scatter(v, "data", op="max"))
    with pytest.raises(ValueError, match=r"all_reduce: algorithm='nccl' is not one of 'xla', "
                       r"'ring', 'tree', 'hierarchical', 'auto'\."):
        trace(lambda v: comm.all_reduce(v, "data", algorithm="nccl"))
    with pytest.raises(ValueError, match=r"algorithm='hierarchical' needs axis=\(outer, inner\)"):
        trace(lambda v: comm.all_reduce(v, "data", algorithm="hierarchical"))


def test_shapes_and_dims():
    with pytest.raises(ValueError, match=r"reduce_scatter: dimension 0 of the array of shape "
                       r"\(3,\) has length 3, which does not divide by the 4 devices of axis "
                       r"'tensor'\. Fix: pad the array, or use ring_reduce_scatter"):
        trace(lambda v: comm.reduce_scatter(v[0, :3], "tensor"))
    with pytest.raises(ValueError, match=r"all_to_all: dimension 1 of the array of shape "
                       r"\(1, 3\) has length 3, which does not divide by the 2 devices"):
        trace(lambda v: comm.all_to_all(v[:, :3], "data", 1, 0))
    with pytest.raises(ValueError, match=r"ring_reduce_scatter: dim=2 is out of range for an "
                       r"array of shape \(1, 8\) \(rank 2\); use -2 <= dim < 2\."):
        trace(lambda v: comm.ring_reduce_scatter(v, "data", dim=2))
    with pytest.raises(ValueError, match=r"ring_all_gather: size=99 must be in 1\.\.16"):
        trace(lambda v: comm.ring_all_gather(v[0], "data", size=99))


def test_permutations():
    with pytest.raises(ValueError, match=r"send: pair \(0, 4\) in perm is out of range for axis "
                       r"'tensor' of size 4; ranks are 0\.\.3\."):
        trace(lambda v: comm.send(v, "tensor", [(0, 4)]))
    with pytest.raises(ValueError, match=r"send: a destination appears twice in perm=\[\(0, 1\), "
                       r"\(2, 1\)\]; each device may send once and receive once"):
        trace(lambda v: comm.send(v, "tensor", [(0, 1), (2, 1)]))
    with pytest.raises(TypeError, match=r"send: perm=\[0, 1\] must be a sequence of"):
        trace(lambda v: comm.send(v, "tensor", [0, 1]))
    with pytest.raises(TypeError, match=r"shift: offset=1.5 must be a Python int"):
        trace(lambda v: comm.shift(v, "tensor", 1.5))


def test_hierarchical_compression_buckets_quantized():
    with pytest.raises(ValueError, match=r"hierarchical_all_reduce: inner_axis='data' and "
                       r"outer_axis='data' overlap; pass two different mesh axes"):
        trace(lambda v: comm.hierarchical_all_reduce(v, "data", "data"))
    with pytest.raises(ValueError, match=r"hierarchical_all_reduce: op='max' is not supported; "
                       r"use one of 'sum', 'mean'\."):
        trace(lambda v: comm.hierarchical_all_reduce(v, "tensor", "data", op="max"))
    with pytest.raises(ValueError, match=r"ring_all_reduce: compression='int4' is not one of "
                       r"Compression.none, Compression.bf16, Compression.fp16"):
        trace(lambda v: comm.ring_all_reduce(v, "data", compression="int4"))
    with pytest.raises(ValueError, match=r"pack_buckets: bucket_bytes=-1 must be an int >= 0 "
                       r"\(0 disables fusion\) or None"):
        trace(lambda v: comm.bucketed_all_reduce({"a": v}, "data", bucket_bytes=-1))
    with pytest.raises(TypeError, match=r"quantized_all_reduce: got a int32 array; int8 "
                       r"quantisation is for floating-point values"):
        trace(lambda v: comm.quantized_all_reduce(v.astype(jnp.int32), "data"))
    with pytest.raises(ValueError, match=r"block_size=0 must be a positive int"):
        trace(lambda v: comm.quantized_all_reduce(v, "data", block_size=0))


def test_cost_and_bench_inputs():
    with pytest.raises(ValueError, match=r"cost.preset: unknown link 'nvlink'; the presets are "
                       r"nvlink-h100, nvlink-a100, tpu-v5e-ici"):
        comm.cost.preset("nvlink")
    with pytest.raises(ValueError, match=r"unknown collective 'gather'"):
        comm.cost.bus_bandwidth_factor("gather", 8)
    from parallax.comm import bench
    with pytest.raises(ValueError, match=r"bench: size '3X' is not a number"):
        bench.parse_size("3X")
