"""parallax.rpc.call_log: an optional record of every worker's calls (caller, callee, times)."""

import pytest

from rpc import rpc_testing as t

pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.usefixtures("ray_cluster")]
T = 30  # seconds


def test_record_calls_collects_every_workers_calls_in_start_order_and_stops(group):
    from parallax.rpc.call_log import record_calls

    with record_calls() as calls:
        assert group.rpc_sync("w1", t.add_on, args=("w2", 1, 2), timeout=T) == 30
    assert calls == sorted(calls, key=lambda c: c.start)
    user_calls = [(c.caller, c.callee, c.kind, c.what) for c in calls if c.kind == "run"]
    assert user_calls == [("driver", "w1", "run", "rpc_sync(add_on)"),
                          ("w1", "w2", "run", "rpc_async(add)")]
    outer, inner = (c for c in calls if c.kind == "run")
    assert outer.start <= inner.start <= inner.end <= outer.end  # nested in time
    with record_calls() as again:
        pass
    assert again == []  # recording stopped on every worker when the first block ended


def test_record_calls_refuses_a_worker_actor_and_nesting(group):
    from parallax.rpc.call_log import record_calls

    with pytest.raises(RuntimeError, match=r"record_calls: worker 'w1' is a worker actor; open "
                                           r"record_calls on the process that called init_rpc"):
        group.rpc_sync("w1", t.open_record_calls, timeout=T)
    with record_calls():
        with pytest.raises(RuntimeError, match="record_calls blocks do not nest"):
            with record_calls():
                pass
