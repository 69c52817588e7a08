"""px.metrics.Throughput against hand computation on a known step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import parallax as px
from parallax.metrics import Throughput, device_memory, live_bytes

B, D, E = 64, 32, 16


def matmul_step():
    mesh = px.make_mesh(data=8)
    x = jax.device_put(np.ones((B, D), np.float32), NamedSharding(mesh, P("data")))
    w = jax.device_put(np.ones((D, E), np.float32), NamedSharding(mesh, P()))
    return jax.jit(lambda x, w: x @ w), x, w


def fake_clock(*times):
    ticks = iter(times)
    return lambda: next(ticks)


def test_flops_from_the_compiled_program_are_the_matmuls_exactly():
    step, x, w = matmul_step()
    meter = Throughput.for_step(step, x, w, items_per_step=B, peak_flops=1e9,
                                clock=fake_clock(0.0, 2.0))
    assert meter.devices == 8
    assert meter.flops_per_step == 2 * B * D * E  # 8 devices x 2 (B/8) D E
    m = meter.step(step(x, w))
    assert m.seconds == 2.0
    assert m.items_per_second == B / 2.0
    assert m.items_per_second_per_device == B / 2.0 / 8
    assert m.flops_per_second_per_device == pytest.approx(2 * B * D * E / 2.0 / 8)
    assert m.mfu == pytest.approx(2 * B * D * E / (2.0 * 8 * 1e9))  # the docstring's formula


def test_data_wait_is_the_time_spent_in_next():
    clock = fake_clock(0.0, 1.0, 1.25, 3.0, 4.0, 4.5, 6.0, 7.0)
    meter = Throughput(items_per_step=10, clock=clock)      # starts at 0.0
    seen = []
    for batch in meter.timed([1, 2]):    # next(): 1.0 -> 1.25, then step at 3.0; 4.0 -> 4.5
        seen.append(meter.step(batch))
    assert [m.data_wait_seconds for m in seen] == [0.25, 0.5]
    assert [m.seconds for m in seen] == [3.0, 3.0]
    assert meter.summary(skip=1)["seconds"] == 3.0


def test_memory_counts_live_arrays_and_the_compiled_peak_on_cpu():
    device = jax.devices()[0]
    before = live_bytes(device)
    x = jax.device_put(jnp.zeros((1000,), jnp.float32), device)
    assert live_bytes(device) - before == 4000
    memory = device_memory(device, compiled_peak=10**9)
    assert memory.source == "live arrays + compiled" and memory.peak == 10**9
    del x


def test_summary_and_table_skip_the_compiling_step():
    meter = Throughput(items_per_step=100, flops_per_step=1e9, devices=2, peak_flops=1e9,
                       clock=fake_clock(0.0, 10.0, 11.0, 12.0, 15.0))
    for _ in range(4):
        meter.step()
    summary = meter.summary()   # medians of 1, 1, 3 s: a slow step does not move them
    assert summary["steps"] == 3 and summary["seconds"] == 1.0
    assert summary["mfu"] == pytest.approx(0.5)
    assert "MFU" in meter.table() and "50.00%" in meter.table()


def test_bad_input_is_named():
    with pytest.raises(ValueError, match=r"px.metrics.Throughput: items_per_step must be a "
                                         r"positive int \(tokens or examples per step"):
        Throughput(items_per_step=0)
    with pytest.raises(ValueError, match=r"px.metrics: peak_flops must be > 0"):
        Throughput(items_per_step=1, peak_flops=-1.0)
    with pytest.raises(ValueError, match=r"summary: no step measured yet"):
        Throughput(items_per_step=1).summary()
