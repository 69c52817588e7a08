"""Partitioners against brute force, PipeDream against the balancers, and bad input."""

import doctest
import importlib
import itertools
import random

import numpy as np
import pytest

from parallax.pipeline import METHODS, LayerProfile, Partition, partition


def all_splits(n, stages):
    for cuts in itertools.combinations(range(1, n), stages - 1):
        yield (0, *cuts, n)


def brute_force(n, stages, stage_cost):
    return min(max(stage_cost(a, b) for a, b in zip(bs, bs[1:])) for bs in all_splits(n, stages))


def random_cases(count, seed):
    rng = random.Random(seed)
    for _ in range(count):
        n = rng.randint(1, 9)
        stages = rng.randint(1, n)
        yield (
            n,
            stages,
            [rng.choice([rng.uniform(0.1, 5.0), float(rng.randint(1, 4))]) for _ in range(n)],
            rng,
        )


def records(times, params, acts):
    return [
        LayerProfile(f"l{i}", t, 0.0, p, a) for i, (t, p, a) in enumerate(zip(times, params, acts))
    ]


def test_balance_by_time_agrees_with_brute_force():
    for n, stages, times, _ in random_cases(200, seed=0):
        split = partition(times, stages, "balance_by_time")
        assert split.bottleneck == pytest.approx(
            brute_force(n, stages, lambda a, b: sum(times[a:b]))
        )
        assert (
            split.boundaries[0] == 0
            and split.boundaries[-1] == n
            and len(split.boundaries) == stages + 1
        )
        assert split.costs == split.compute and sum(split.compute) == pytest.approx(sum(times))


def test_balance_by_size_agrees_with_brute_force():
    for n, stages, times, rng in random_cases(200, seed=1):
        params = [rng.randint(0, 1000) for _ in range(n)]
        acts = [rng.randint(1, 500) for _ in range(n)]
        size = [3.0 * p + a for p, a in zip(params, acts)]
        split = partition(records(times, params, acts), stages, "balance_by_size",
                          param_scale=3.0)
        assert split.bottleneck == pytest.approx(brute_force(n, stages, lambda a, b: sum(size[a:b])))
        # plain numbers are the sizes themselves
        assert partition(size, stages, "balance_by_size").bottleneck == pytest.approx(
            split.bottleneck
        )


@pytest.mark.parametrize("overlap", [False, True])
def test_pipedream_agrees_with_brute_force_and_beats_the_balancers(overlap):
    for n, stages, times, rng in random_cases(200, seed=2 + overlap):
        acts = [rng.randint(1, 4000) for _ in range(n)]
        bandwidth = rng.choice([100.0, 1000.0, 10000.0])
        layers = records(times, [1] * n, acts)

        def cost(a, b):
            compute, comm = sum(times[a:b]), acts[b - 1] / bandwidth if b < n else 0.0
            return max(compute, comm) if overlap else compute + comm

        split = partition(layers, stages, "pipedream", bandwidth=bandwidth, overlap=overlap)
        assert split.bottleneck == pytest.approx(brute_force(n, stages, cost))
        for method in ("uniform", "balance_by_time", "balance_by_size"):
            other = partition(layers, stages, method, bandwidth=bandwidth, overlap=overlap)
            evaluated = Partition.from_boundaries(
                layers, other.boundaries, bandwidth=bandwidth, overlap=overlap
            )
            assert split.bottleneck <= evaluated.bottleneck + 1e-12
            if method != "balance_by_size":  # the time methods report communication too
                assert other.costs == pytest.approx(evaluated.costs)


def test_pipedream_avoids_cutting_at_a_large_activation():
    times = [1.0, 1.0, 1.0, 1.0]
    acts = [10, 1000, 10, 10]  # cutting after layer 1 sends 1000 bytes
    by_time = partition(times, 2, "balance_by_time", bandwidth=100.0, activation_bytes=acts)
    pipedream = partition(times, 2, "pipedream", bandwidth=100.0, activation_bytes=acts)
    assert by_time.boundaries == (0, 2, 4) and by_time.costs == (12.0, 2.0)
    assert pipedream.boundaries == (0, 1, 4) and pipedream.costs == (1.1, 3.0)
    # without a bandwidth, pipedream is balance_by_time
    assert partition(times, 2, "pipedream").boundaries == by_time.boundaries


def test_uniform_and_plan_properties():
    split = partition([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 4, "uniform")
    assert split.layers_per_stage == (3, 3, 2, 2)
    assert split.boundaries == (0, 3, 6, 8, 10)
    assert split.costs == (6.0, 15.0, 15.0, 19.0)
    assert split.slowest == 3 and split.bottleneck == 19.0
    assert split.imbalance == pytest.approx(19.0 / (55.0 / 4))
    assert list(split.layers(1)) == [3, 4, 5]
    assert split.text().splitlines()[:2] == [
        "uniform: 4 stages, bottleneck 19 (stage 3), imbalance 1.382",
        "stage 0: layers 0-2 (3), compute 6, comm 0, cost 6",
    ]
    assert partition([2.0, 2.0], 2).imbalance == 1.0
    assert partition([5.0, 1.0, 1.0], 1).boundaries == (0, 3)
    assert partition(np.array([1.0, 1.0, 2.0, 4.0]), 2).boundaries == (0, 3, 4)
    assert METHODS == ("uniform", "balance_by_time", "balance_by_size", "pipedream")


@pytest.mark.parametrize(
    "args,kwargs,error,message",
    [
        (
            ([1, 2, 3], 4),
            {},
            ValueError,
            r"partition: 4 stages for 3 layers; every stage needs at least one layer",
        ),
        (
            ([1, 0, 3], 2),
            {},
            ValueError,
            r"partition: layer 1 has cost 0.0 \(time\); costs must be positive",
        ),
        (([1, -2, 3], 2), {}, ValueError, r"partition: layer 1 has cost -2.0 \(time\)"),
        (([1, float("nan")], 2), {}, ValueError, r"partition: layer 1 has cost nan"),
        (
            ([1, 2], 2, "metis"),
            {},
            ValueError,
            r"unknown method 'metis'; known: uniform, balance_by_time, balance_by_size, pipedream",
        ),
        (([1, 2], 0), {}, ValueError, r"partition: stages must be >= 1, got 0"),
        (([], 1), {}, ValueError, r"partition: costs is empty"),
        (
            ([1, 2], 2, "pipedream"),
            {"bandwidth": 1.0},
            ValueError,
            r"communication needs per-layer activation bytes",
        ),
        (([1, 2], 2, "pipedream"), {"bandwidth": 0.0}, ValueError, r"bandwidth must be positive"),
        (([1, 2], 2), {"activation_bytes": [1]}, ValueError, r"1 activation sizes for 2 layers"),
        (
            ("ab", 2),
            {},
            TypeError,
            r"costs must be a sequence of numbers or profile records, got str",
        ),
        (([1, "x"], 2), {}, TypeError, r"costs\[1\] is 'x'"),
        (([1, 2], 2.0), {}, TypeError, r"stages must be an int"),
    ],
)
def test_bad_input(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        partition(*args, **kwargs)


def test_from_boundaries_checks_them():
    assert Partition.from_boundaries([1.0, 2.0, 3.0], (0, 2, 3)).costs == (3.0, 3.0)
    with pytest.raises(
        ValueError,
        match=r"boundaries \(0, 2, 2, 3\) must rise strictly from 0 to the number of layers \(3\)",
    ):
        Partition.from_boundaries([1.0, 2.0, 3.0], (0, 2, 2, 3))


def test_docstring_examples_run():
    result = doctest.testmod(importlib.import_module("parallax.pipeline.planning.partition"))
    assert result.failed == 0 and result.attempted > 0
