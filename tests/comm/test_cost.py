"""The alpha-beta model: formulas, the crossover, presets with sources, fitting."""

import math

import pytest

from parallax.comm import cost


def test_ring_formulas():
    link = cost.Link("t", latency=1e-6, bandwidth=1e9)
    s, n = 8e6, 8
    assert cost.ring_reduce_scatter_time(s, n, link) == pytest.approx(7e-6 + 7 / 8 * 8e-3)
    assert cost.ring_all_gather_time(s, n, link) == cost.ring_reduce_scatter_time(s, n, link)
    assert cost.ring_all_reduce_time(s, n, link) == pytest.approx(14e-6 + 14 / 8 * 8e-3)
    assert cost.tree_all_reduce_time(s, n, link) == pytest.approx(3 * (1e-6 + 8e-3))
    assert cost.tree_all_reduce_time(s, 6, link) == pytest.approx(4 * (1e-6 + 8e-3))
    assert cost.broadcast_time(s, 5, link) == pytest.approx(3 * (1e-6 + 8e-3))
    assert cost.ring_all_reduce_time(s, 1, link) == 0.0


def test_ring_bandwidth_term_does_not_grow_with_n():
    link = cost.Link("t", latency=0.0, bandwidth=1e9)
    times = [cost.ring_all_reduce_time(1e9, n, link) for n in (2, 8, 64, 1024)]
    assert all(t < 2.0 for t in times) and times == sorted(times)


@pytest.mark.parametrize("name", sorted(cost.PRESETS))
def test_crossover_separates_tree_from_ring(name):
    link = cost.preset(name)
    assert link.source and link.latency > 0 and link.bandwidth > 0
    for n in (4, 8, 16):
        x = cost.crossover_bytes(n, link)
        assert cost.choose_algorithm(x / 2, n, link) == "tree"
        assert cost.choose_algorithm(x * 2, n, link) == "ring"
        assert cost.ring_all_reduce_time(x, n, link) == pytest.approx(
            cost.tree_all_reduce_time(x, n, link))
    assert cost.crossover_bytes(2, link) == math.inf   # n=2: the tree is never worse


def test_hierarchical_beats_flat_on_a_slow_outer_network():
    flat = cost.ring_all_reduce_time(1e9, 64, "ethernet-100g")
    two_d = cost.hierarchical_all_reduce_time(1e9, 8, 8, "nvlink-h100", "ethernet-100g")
    assert two_d < flat / 4


def test_bucketing_saves_latencies():
    leaves = [4e3] * 100
    link = cost.preset("ethernet-100g")
    one_each = cost.bucketed_all_reduce_time(leaves, 0, 8, link)
    fused = cost.bucketed_all_reduce_time(leaves, 25 * 2**20, 8, link)
    assert fused < one_each / 50
    assert one_each == pytest.approx(100 * cost.ring_all_reduce_time(4e3, 8, link))


def test_fit_link_recovers_the_parameters():
    link = cost.Link("x", 5e-6, 3e9)
    sizes = [2.0**k for k in range(10, 24, 2)]
    for algorithm, f in (("ring", cost.ring_all_reduce_time), ("tree", cost.tree_all_reduce_time)):
        fit = cost.fit_link(sizes, [f(s, 8, link) for s in sizes], 8, algorithm)
        assert fit.latency == pytest.approx(5e-6, rel=1e-6)
        assert fit.bandwidth == pytest.approx(3e9, rel=1e-6)


def test_bus_bandwidth_factors_are_nccl_tests():
    assert cost.bus_bandwidth_factor("all_reduce", 8) == 2 * 7 / 8
    assert cost.bus_bandwidth_factor("all_gather", 8) == 7 / 8
    assert cost.bus_bandwidth_factor("reduce_scatter", 4) == 3 / 4
    assert cost.bus_bandwidth_factor("broadcast", 8) == 1.0


def test_default_link_by_backend():
    assert cost.default_link("gpu").name == "nvlink-h100"
    assert cost.default_link("tpu").name == "tpu-v5e-ici"
    assert cost.default_link("cpu").name == "cpu-sim"
    # XLA's own collectives: one in-process step on simulated CPU devices, the same link elsewhere
    assert cost.default_link("cpu", xla=True).name == "cpu-sim-xla"
    assert cost.default_link("gpu", xla=True).name == "nvlink-h100"
