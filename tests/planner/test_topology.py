"""A cluster's two levels: where each mesh axis lives, and each collective priced per level."""

import math

import jax
import pytest

import parallax as px
from parallax.comm import cost
from parallax.planner import topology
from parallax.planner.topology import INTER, INTRA, Topology, cluster

DGX = cluster("dgx-h100")


def test_presets_cite_their_hardware():
    a100, h100 = cluster("dgx-a100"), DGX
    assert (a100.chip, a100.devices_per_node, a100.node_bandwidth) == ("a100", 8, 200e9)
    assert (h100.chip, h100.devices_per_node, h100.node_bandwidth) == ("h100", 8, 400e9)
    assert a100.intra.name == "nvlink-a100" and h100.intra.name == "nvlink-h100"
    assert "Narayanan" in a100.source and "DGX H100" in h100.source
    with pytest.raises(ValueError, match=r"topology.cluster: unknown cluster 'dgx-x'; the "
                                         r"presets are dgx-h100, dgx-a100"):
        cluster("dgx-x")


def test_nodes_fill_with_the_innermost_axes_as_make_hybrid_mesh_lays_them_out():
    """The split agrees with px.make_hybrid_mesh on 8 devices in nodes of 4 (simulated:
    consecutive devices stand for a node), device by device."""
    four = Topology("four", "h100", 4, DGX.intra, DGX.network)
    shape = {"stage": 2, "data": 2, "tensor": 2}
    ici, dcn = four.hybrid_axes(shape)
    assert (ici, dcn) == ({"data": 2, "stage": 1, "tensor": 2}, {"data": 1, "stage": 2,
                                                                 "tensor": 1})
    mesh = px.make_hybrid_mesh(ici, dcn)
    node = {d.id: d.id // 4 for d in jax.devices()}
    grid = mesh.devices  # axes data, stage, tensor
    for axis, (inner, outer) in four.split(shape).items():
        i = mesh.axis_names.index(axis)
        groups = [grid.take(k, axis=i) for k in range(grid.shape[i])]
        spans = {tuple(node[d.id] for d in g.flat) for g in groups}
        # an axis inside a node keeps every group on one node; one across nodes does not
        crosses = any(len({node[d.id] for d in line}) > 1
                      for line in grid.swapaxes(i, -1).reshape(-1, grid.shape[i]))
        assert crosses == (outer > 1), (axis, spans)
    with pytest.raises(ValueError, match=r"does not fill four's nodes of 4 devices"):
        four.hybrid_axes({"data": 3, "tensor": 3})


def test_a_group_inside_a_node_uses_the_link_only():
    t = DGX.collective_seconds("all-reduce", ("tensor",), {"data": 4, "tensor": 8}, 1e9)
    assert t[INTER] == 0 and t[INTRA] == pytest.approx(cost.ring_all_reduce_time(1e9, 8,
                                                                                 DGX.intra))


def test_the_hierarchical_all_reduce_beats_a_flat_ring_over_the_network():
    shape = {"data": 64, "fsdp": 8}
    t = DGX.collective_seconds("all-reduce", ("data", "fsdp"), shape, 4e9)
    inner = 2 * cost.ring_reduce_scatter_time(4e9, 8, DGX.intra)
    outer = cost.all_reduce_time(4e9 / 8, 64, DGX.network, "xla")
    assert t[INTRA] == pytest.approx(inner) and t[INTER] == pytest.approx(outer)
    assert sum(t.values()) < cost.ring_all_reduce_time(4e9, 512, DGX.network) / 4


def test_gathers_scatters_all_to_alls_and_permutes_by_level():
    shape = {"stage": 4, "data": 2, "tensor": 8}
    gather = DGX.collective_seconds("all-gather", ("data", "tensor"), shape, 1e9)
    assert gather[INTRA] == pytest.approx(cost.ring_reduce_scatter_time(1e9, 8, DGX.intra))
    assert gather[INTER] == pytest.approx(cost.ring_reduce_scatter_time(1e9 / 8, 2,
                                                                        DGX.network))
    permute = DGX.collective_seconds("collective-permute", ("stage",), shape, 1e8, count=10)
    assert permute[INTRA] == 0 and permute[INTER] == pytest.approx(10 * DGX.network.time(1e7))
    # all-to-all across nodes is limited by the bisection: half of it doubles the time
    a2a = DGX.collective_seconds("all-to-all", ("data", "tensor"), shape, 1e9)
    half = Topology("half", "h100", 8, DGX.intra, DGX.network, bisection=0.5)
    slow = half.collective_seconds("all-to-all", ("data", "tensor"), shape, 1e9)
    assert slow[INTRA] == a2a[INTRA]
    byte_time = (16 - 8) / 16 * 1e9 / DGX.network.bandwidth
    assert slow[INTER] - a2a[INTER] == pytest.approx(byte_time)
    with pytest.raises(ValueError, match="unknown collective kind 'broadcast'"):
        DGX.collective_seconds("broadcast", ("data",), shape, 1.0)


def test_one_node_is_what_a_chip_and_its_link_describe():
    one = topology.single_node("h100", cost.preset("nvlink-h100"), 8)
    t = one.collective_seconds("all-reduce", ("data",), {"data": 8}, 1e9)
    assert t[INTER] == 0 and math.isclose(t[INTRA], cost.ring_all_reduce_time(1e9, 8,
                                                                              "nvlink-h100"))
