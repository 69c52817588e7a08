"""hvd.elastic.run retries as Horovod's run_fn: HorovodInternalError restores the last commit
and calls again, HostsUpdatedInterrupt continues from the current state (syncing unless
skip_sync), reset callbacks run after each, reset_limit bounds the retries; ObjectState
commits, restores and syncs small values (horovod/common/elastic.py)."""

import re

import pytest

import parallax.horovod as hvd


def test_object_state_commits_restores_and_syncs():
    state = hvd.elastic.ObjectState(epoch=0, seen=[])
    state.epoch, state.seen = 2, [1]
    state.commit()
    state.epoch = 5
    state.seen.append(2)
    state.restore()
    assert (state.epoch, state.seen) == (2, [1])  # the commit is a copy
    state.sync()
    assert state.epoch == 2


def test_run_restores_on_internal_error_and_continues_on_hosts_updated():
    state = hvd.elastic.ObjectState(step=0)
    resets, synced, seen = [], [], []
    state.register_reset_callbacks([lambda: resets.append(state.step)])
    real_sync = state.sync
    state.sync = lambda: (synced.append(state.step), real_sync())

    @hvd.elastic.run
    def train(state):
        seen.append(state.step)
        while state.step < 4:
            state.step += 1
            if state.step == 2:
                state.commit()
            if state.step == 3 and len(seen) == 1:
                raise hvd.HorovodInternalError("lost a peer")  # back to the commit: 2
            if state.step == 4 and len(seen) == 2:
                raise hvd.HostsUpdatedInterrupt(skip_sync=True)  # keep going from 4
        return state.step

    assert train(state) == 4
    assert seen == [0, 2, 4]
    assert resets == [2, 4]
    assert synced == [0, 2]  # no sync after the skip_sync interrupt


def test_reset_limit_bounds_the_retries():
    state = hvd.elastic.ObjectState(step=0)

    @hvd.elastic.run(reset_limit=1)
    def always_fails(state):
        raise hvd.HorovodInternalError("down")

    with pytest.raises(RuntimeError, match=re.escape(
            "hvd.elastic.run: 2 resets in this process, over reset_limit=1.")):
        always_fails(state)
