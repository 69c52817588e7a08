"""px.metrics.Monitor: what a loop's bar shows, what it logs, which steps it traces."""

import argparse
import json

import jax.numpy as jnp
import pytest

from parallax.metrics import Monitor, Throughput, add_arguments


def fake_meter(times):
    ticks = iter(times)
    return Throughput(items_per_step=1000, flops_per_step=4e9, devices=8, peak_flops=1e9,
                      clock=lambda: next(ticks))


def test_a_resumed_loop_logs_shows_and_tables_its_steps(tmp_path):
    # Steps 11 and 12 of a resumed run, 0.5 s and 2 s each (the clock's first tick is the
    # meter's creation, the second its start in loop()).
    monitor = Monitor(fake_meter([0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 2.5, 2.5]), logdir=tmp_path,
                      progress=False, first_step=11)
    with monitor:
        for batch in monitor.loop([jnp.ones(2), jnp.ones(2)]):
            measured = monitor.step(batch, loss=jnp.float32(1.5), note="warm")
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"], r["note"], r["mfu"]) for r in rows] == [
        (11, 1.5, "warm", 1.0), (12, 1.5, "warm", 0.25)]
    assert monitor.postfix(measured, loss=1.5) == {
        "loss": "1.5000", "tok/s/dev": "62", "MFU": "25.0%",
        "mem": measured.postfix()["mem"]}
    table = monitor.table()
    assert "steps measured        1 (first 1 skipped" in table and "MFU" in table
    assert f"metrics logged to {tmp_path}/metrics.jsonl" in table


def test_the_scripts_flags_and_the_profiled_steps(tmp_path):
    args = add_arguments(argparse.ArgumentParser()).parse_args(
        ["--logdir", str(tmp_path), "--profile-steps", "2:3"])
    monitor = Monitor(items_per_step=4, logdir=args.logdir,
                      profile_steps=args.profile_steps, progress=False)
    traced = []
    with monitor:
        for x in monitor.loop([jnp.ones(4)] * 3):
            traced.append(monitor.profiler.tracing)
            monitor.step(x * 2)
    assert traced == [False, True, False]
    assert list(tmp_path.glob("plugins/profile/*/perfetto_trace.json.gz"))
    assert f"profile of step 2 in {tmp_path}/plugins/profile" in monitor.table()


def test_a_monitor_needs_one_meter():
    with pytest.raises(ValueError, match=r"px.metrics.Monitor: pass a Throughput meter or "
                                         r"items_per_step \(with flops_per_step\), not both "
                                         r"nor neither; got meter=None, items_per_step=None."):
        Monitor()
    with pytest.raises(ValueError, match=r"px.metrics.Monitor: progress must be True, False "
                                         r"or 'auto', got 'yes'."):
        Monitor(items_per_step=1, progress="yes")


def test_recorded_values_are_logged_at_their_step_and_stay_in_the_bar(tmp_path):
    monitor = Monitor(fake_meter([0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 1.0, 1.0]),
                      logdir=tmp_path, progress=False)
    with monitor:
        for i, batch in enumerate(monitor.loop([jnp.ones(2), jnp.ones(2)])):
            measured = monitor.step(batch, loss=jnp.float32(2.0))
            if i == 0:
                monitor.record({"eval_loss": 1.25, "eval_perplexity": 3.4903})
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 1, 2]
    assert rows[1] == {"step": 1, "eval_loss": 1.25, "eval_perplexity": 3.4903}
    shown = monitor.postfix(measured, loss=2.0)
    assert list(shown)[:3] == ["loss", "eval_loss", "eval_perplexity"]
    assert shown["eval_loss"] == "1.2500" and shown["eval_perplexity"] == "3.4903"
