"""px.metrics.MetricsLog files and px.profile traces, read back."""

import gzip
import json
import struct

import jax
import jax.numpy as jnp
import pytest

import parallax as px
from parallax.metrics import MetricsLog, parse_steps


def tensorboard_scalars(path):
    """(tag, step, value) of a TensorBoard event file (TFRecord framing, Event protos)."""
    from tensorboardX.proto import event_pb2

    data, out, i = path.read_bytes(), [], 0
    while i < len(data):
        (length,) = struct.unpack("<Q", data[i:i + 8])
        event = event_pb2.Event.FromString(data[i + 12:i + 12 + length])
        i += 12 + length + 4
        out += [(v.tag, event.step, v.simple_value) for v in event.summary.value]
    return out


def test_json_lines_and_tensorboard_are_written_and_read_back(tmp_path):
    with MetricsLog(tmp_path) as log:
        log.write(1, {"loss": 2.0, "mfu": 0.25, "strategy": "dp", "step": 1})
        log.write(2, {"loss": float("nan")})
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "loss": 2.0, "mfu": 0.25, "strategy": "dp"},  # step an int
                    {"step": 2, "loss": None}]
    (events,) = tmp_path.glob("events.out.tfevents.*")
    assert sorted(tensorboard_scalars(events)) == [("loss", 1, 2.0), ("mfu", 1, 0.25)]


def test_only_process_zero_writes_by_default(tmp_path, monkeypatch):
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    with MetricsLog(tmp_path / "run") as log:
        log.write(1, {"loss": 1.0})
    assert not (tmp_path / "run").exists()
    with MetricsLog(tmp_path / "all", all_processes=True, tensorboard=False) as log:
        log.write(1, {"loss": 1.0})
    assert (tmp_path / "all" / "process_1" / "metrics.jsonl").exists()


def test_a_profile_traces_the_chosen_steps_only(tmp_path):
    step = jax.jit(lambda x: jnp.sin(x) * 2)
    profiler = px.profile(tmp_path, "2:3")
    for i in range(1, 5):
        profiler.step(i)
        assert profiler.tracing == (i == 2)
        step(jnp.ones(8) * i).block_until_ready()
    profiler.close()
    (perfetto,) = tmp_path.glob("plugins/profile/*/perfetto_trace.json.gz")
    trace = json.load(gzip.open(perfetto))
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    assert any("<lambda>" in str(e.get("name", "")) for e in events)  # the step, by name


def test_profile_steps_are_checked():
    assert list(parse_steps("3:5")) == [3, 4]
    with pytest.raises(ValueError, match=r"px.profile: steps '5:3' must satisfy 1 <= FIRST "
                                         r"< STOP"):
        parse_steps("5:3")
    with pytest.raises(ValueError, match=r"px.profile: steps 'x' must be FIRST:STOP"):
        parse_steps("x")
