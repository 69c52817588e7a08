"""Auto-sharding under ``parallax launch -np 2``: each worker gets TF's rows; training equals one process."""

import json
import re
import sys

import jax
import numpy as np
import pytest

import parallax as px
from tests.distributed.launching import run_launcher
from tests.distributed.launching import test_env as launch_env

from .tf_testing import GLOBAL_BATCH, train_mirrored

FILES = (0, 1, 2, 3)
PER_FILE = 16


def read_file(f):
    """File ``f``'s 16 examples: features [8] (row id in column 0) and a label."""
    rng = np.random.default_rng(f)
    x = rng.standard_normal((PER_FILE, 8)).astype(np.float32)
    x[:, 0] = 100 * f + np.arange(PER_FILE)
    return [(x[i], np.int32(rng.integers(0, 4))) for i in range(PER_FILE)]


def tensorflows_rows(policy, worker, workers=2, replicas=2):
    """Each step's rows per replica of ``worker``, TensorFlow's rule written out plainly."""
    if policy == "DATA":  # all files; each batch of 32 -> 4 mini-batches; keep i % W == k
        stream = [e for f in FILES for e in read_file(f)]
        size = GLOBAL_BATCH // (workers * replicas)
        minibatches = [stream[i:i + size] for i in range(0, len(stream), size)]
        mine = [mb for i, mb in enumerate(minibatches) if i % workers == worker]
    else:  # FILE: files k, k+W; batches of 32 -> 4 mini-batches (sizes for worker k: 8 each)
        stream = [e for f in FILES[worker::workers] for e in read_file(f)]
        size = GLOBAL_BATCH // (workers * replicas)
        mine = [stream[i:i + size] for i in range(0, len(stream), size)]
    return [[np.stack([x for x, _ in mb]) for mb in mine[s:s + replicas]]
            for s in range(0, len(mine), replicas)]


def global_batches(policy, workers=2):
    """The global batch of each step: every worker's rows of that step, in worker order."""
    by_worker = [tensorflows_rows(policy, k) for k in range(workers)]
    labels = {float(x[0]): y for f in FILES for x, y in read_file(f)}
    out = []
    for step in range(len(by_worker[0])):
        x = np.concatenate([mb for k in range(workers) for mb in by_worker[k][step]])
        out.append((x, np.asarray([labels[float(v)] for v in x[:, 0]], np.int32)))
    return out


@pytest.mark.multiprocess
@pytest.mark.slow
def test_data_and_file_sharding_over_two_workers():
    result = run_launcher(
        ["-np", "2", "--devices-per-process", "2", sys.executable,
         "tests/tf/programs/auto_shard.py"],
        env=launch_env(JAX_DEFAULT_MATMUL_PRECISION="highest"))
    assert result.returncode == 0, result.stderr[-3000:]
    workers = sorted((json.loads(line) for line in re.findall(r"^\[\d\] RESULT (.*)$",
                                                               result.stdout, re.M)),
                     key=lambda w: w["rank"])
    assert [w["rank"] for w in workers] == [0, 1]
    for policy in ("DATA", "FILE"):
        for k, w in enumerate(workers):
            want = tensorflows_rows(policy, k)
            got = w[policy]["rows"]
            assert len(got) == len(want) == 2  # two steps of 32 rows, 16 from each worker
            for got_step, want_step in zip(got, want):
                for g, t in zip(got_step, want_step, strict=True):
                    np.testing.assert_array_equal(np.asarray(g, np.float32), t)
        # The one-process run over the same global batches: MirroredStrategy on 4 devices.
        losses, state, _ = train_mirrored(px.tf.MirroredStrategy(devices=[0, 1, 2, 3]),
                                          batch_norm=False, data=global_batches(policy))
        ref = {jax.tree_util.keystr(p): np.asarray(x)
               for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}
        for w in workers:
            assert px.testing.relative_difference(w[policy]["losses"], losses) <= 1e-5
            assert px.testing.relative_difference(
                [np.asarray(w[policy]["state"][k]) for k in sorted(ref)],
                [ref[k] for k in sorted(ref)]) <= 1e-5
