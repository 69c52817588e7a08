"""MultiWorkerMirroredStrategy under ``parallax launch -np 2`` equals the one-process run."""

import json
import re
import sys

import jax
import numpy as np
import pytest

import parallax as px
from tests.distributed.launching import run_launcher
from tests.distributed.launching import test_env as launch_env

from .tf_testing import launched_workers, train_mirrored

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def test_two_workers_equal_one_process():
    workers = launched_workers("multi_worker.py")
    assert [w["rank"] for w in workers] == [0, 1]
    for w in workers:
        assert (w["workers"], w["replicas"], w["local"], w["axes"]) == (
            2, 4, 2, ["worker", "replica"])
    assert workers[0]["losses"] == workers[1]["losses"]
    assert workers[0]["state"] == workers[1]["state"]  # mirrored: the same on both workers

    # The one-process run: MirroredStrategy on 4 devices of this process, same loop.
    losses, state, accuracy = train_mirrored(px.tf.MirroredStrategy(devices=[0, 1, 2, 3]),
                                             batch_norm=True)
    ref_state = {jax.tree_util.keystr(p): np.asarray(x).tolist()
                 for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}
    for w in workers:
        assert px.testing.relative_difference(w["losses"], losses) <= 1e-5
        assert px.testing.relative_difference(
            [np.asarray(w["state"][k]) for k in sorted(ref_state)],
            [np.asarray(ref_state[k]) for k in sorted(ref_state)]) <= 1e-5
        assert w["accuracy"] == accuracy
