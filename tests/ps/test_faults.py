"""A parameter server killed by pid: a clear error within seconds, then a restart from the
checkpoint of the servers' state that finishes the run exactly."""

import os
import signal
import time

import numpy as np
import optax
import pytest

import parallax as px
from ps import ps_testing

pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.usefixtures("ray_cluster"),
              pytest.mark.slow]

LR, STEPS, CHECKPOINT_AT, KILLED_AT = 0.1, 10, 4, 6


def sgd_steps(worker, keys, x, y, steps):
    for _ in range(steps):
        w = worker.wait(worker.pull(keys))
        worker.wait(worker.push(keys, (x.T @ (x @ w - y) / len(y)).astype(np.float32)))


def test_killed_server_raises_within_seconds_and_checkpoint_restart_finishes(store, tmp_path):
    x, y, _ = ps_testing.least_squares(rows=64, dim=6)
    w = np.zeros(6, np.float32)
    for _ in range(STEPS):  # the uninterrupted run, on one device
        w = w - LR * (x.T @ (x @ w - y) / len(y))

    ranges = px.ps.server_key_ranges(3)
    keys = np.array([0, 1, ranges[1].begin, ranges[1].begin + 1, ranges[2].begin,
                     ranges[2].begin + 1], np.uint64)  # on every server
    doomed = px.ps.KVStore(num_servers=3, handle=optax.sgd(LR))
    client, worker = doomed.client(), doomed.worker(0)
    client.wait(client.push(keys, np.zeros(6, np.float32), cmd=px.ps.ASSIGN))
    sgd_steps(worker, keys, x, y, CHECKPOINT_AT)
    doomed.save(tmp_path / "ckpt")
    sgd_steps(worker, keys, x, y, KILLED_AT - CHECKPOINT_AT)  # lost with the server

    os.kill(doomed.server_pids()[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(px.ps.ServerUnavailableError,
                       match=r"server 1 of 3 \(keys \[6148914691236517205, .*from a checkpoint"):
        worker.wait(worker.pull(keys))
    assert time.monotonic() - start < 5
    doomed.shutdown()

    # the run goes on in another store of 3 servers (the session's: new processes cost seconds)
    store.reset(handle=optax.sgd(LR), consistency="sequential", num_workers=1)
    store.restore(tmp_path / "ckpt")
    worker = store.worker(0)
    assert worker.iteration == CHECKPOINT_AT  # resumes where the checkpoint left off
    sgd_steps(worker, keys, x, y, STEPS - CHECKPOINT_AT)
    final = worker.wait(worker.pull(keys))
    np.testing.assert_allclose(final, w, rtol=1e-5, atol=1e-6)
