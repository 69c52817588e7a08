"""Profiling a tiny MLP-like stack: flops, bytes, times, and feeding the partitioner."""

import doctest
import importlib
import math

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from parallax.pipeline import LayerProfile, partition, profile_layers
from parallax.pipeline.planning.profile import _flops

B, D_IN, D_HID, D_OUT = 8, 16, 32, 4


def dense(params, x):
    return x @ params["w"]


def mlp_layers():
    k1, k2 = jax.random.split(jax.random.key(0))
    return [
        (dense, {"w": jax.random.normal(k1, (D_IN, D_HID))}),
        jnp.tanh,
        (dense, {"w": jax.random.normal(k2, (D_HID, D_OUT))}),
    ]


def test_profile_measures_flops_bytes_and_time():
    records = profile_layers(mlp_layers(), jnp.ones((B, D_IN)), repeats=3)
    assert [r.name for r in records] == ["dense", "tanh", "dense"]
    first, act, last = records
    assert first.flops == pytest.approx(2 * B * D_IN * D_HID, rel=0.05)
    assert last.flops == pytest.approx(2 * B * D_HID * D_OUT, rel=0.05)
    assert (first.param_bytes, first.activation_bytes) == (D_IN * D_HID * 4, B * D_HID * 4)
    assert (act.param_bytes, act.activation_bytes) == (0, B * D_HID * 4)
    assert (last.param_bytes, last.activation_bytes) == (D_HID * D_OUT * 4, B * D_OUT * 4)
    assert all(r.time > 0 and math.isfinite(r.time) for r in records)


def test_profile_reads_nnx_modules():
    layer = nnx.Linear(D_IN, D_HID, rngs=nnx.Rngs(0))
    (record,) = profile_layers([layer], jnp.ones((B, D_IN)), repeats=1, warmup=0)
    assert record.name == "Linear"
    assert record.param_bytes == (D_IN * D_HID + D_HID) * 4
    assert record.activation_bytes == B * D_HID * 4
    assert record.flops >= 2 * B * D_IN * D_HID
    (pair,) = profile_layers([(lambda m, x: m(x) * 2, layer)], jnp.ones((B, D_IN)), repeats=1)
    assert pair.param_bytes == record.param_bytes and pair.name == "<lambda>"


def test_records_feed_the_partitioner():
    records = profile_layers(mlp_layers(), jnp.ones((B, D_IN)), repeats=2)
    plan = partition(records, 2, "pipedream", bandwidth=1e9)
    assert plan.stages == 2 and plan.boundaries[-1] == 3
    assert partition(records, 3, "balance_by_size").compute == tuple(
        2.0 * r.param_bytes + r.activation_bytes for r in records
    )


def test_cost_analysis_as_dict_or_list():
    class Compiled:
        def __init__(self, analysis):
            self.analysis = analysis

        def cost_analysis(self):
            return self.analysis

    assert _flops(Compiled({"flops": 12.0})) == 12.0
    assert _flops(Compiled([{"flops": 7.0}])) == 7.0
    assert _flops(Compiled({"bytes accessed": 3.0})) == 0.0  # no flops counted
    assert math.isnan(_flops(Compiled(None))) and math.isnan(_flops(Compiled([])))


def test_bad_layers():
    with pytest.raises(
        TypeError, match=r"profile_layers: layers\[1\] is a int; pass a callable f\(x\), a pair"
    ):
        profile_layers([jnp.tanh, 3], jnp.ones(2))
    with pytest.raises(ValueError, match="profile_layers: repeats must be an int >= 1, got 0"):
        profile_layers([jnp.tanh], jnp.ones(2), repeats=0)
    with pytest.raises(TypeError, match="profile_layers: layers must be a non-empty sequence"):
        profile_layers([], jnp.ones(2))
    with pytest.raises(TypeError) as info:  # a layer's own error names the layer
        profile_layers(mlp_layers()[::-1], jnp.ones((B, D_IN)))
    assert any(
        "profile_layers: raised by layers[0] (dense) on an input of shape (8, 16)" in n
        for n in info.value.__notes__
    )


def test_records_are_plain_values():
    r = LayerProfile("x", 1.0, 2.0, 3, 4)
    assert r._replace(time=2.0).time == 2.0


def test_docstring_example_runs():
    result = doctest.testmod(importlib.import_module("parallax.pipeline.planning.profile"))
    assert result.failed == 0 and result.attempted > 0
