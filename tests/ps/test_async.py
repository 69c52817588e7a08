"""Several asynchronous workers on a convex problem, under each consistency model."""

import math

import numpy as np
import optax
import pytest

import parallax as px
from ps import ps_testing

pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.usefixtures("ray_cluster"),
              pytest.mark.slow]

STEPS, BATCH = 40, 32
DELAYS = (0.0, 0.002, 0.01)  # worker 0 is fast, worker 2 slow: staleness builds up


@pytest.mark.parametrize("consistency, bound", [
    ("sequential", 0),
    (px.ps.BoundedDelay(2), 2),
    ("eventual", math.inf),
])
def test_async_sgd_converges_and_staleness_respects_the_model(store, consistency, bound):
    x, y, w_star = ps_testing.least_squares()
    store.reset(handle=optax.sgd(0.05), consistency=consistency, num_workers=3)
    keys = np.arange(x.shape[1], dtype=np.uint64)
    client = store.client()
    client.wait(client.push(keys, np.zeros(x.shape[1], np.float32), cmd=px.ps.ASSIGN))

    seen = px.ps.run_workers(store, ps_testing.regression_worker, x, y, STEPS, BATCH, DELAYS)
    w = client.wait(client.pull(keys))
    measured = store.staleness()  # recorded by the servers, one entry per pull and server
    assert len(measured) == 3 * STEPS
    assert max(max(s) for s in seen) == measured.max()
    print(f"{consistency}: staleness max {measured.max()}, mean {measured.mean():.2f}")
    if math.isinf(bound):
        assert measured.max() > 2  # eventual: the fast worker runs far ahead
    else:
        assert measured.max() == bound  # reached, never exceeded
    assert np.linalg.norm(w - w_star) / np.linalg.norm(w_star) < 1e-2
