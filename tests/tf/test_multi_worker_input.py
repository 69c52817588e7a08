"""Auto-sharding under ``parallax launch -np 2``: TF's rows per worker, training as one process."""

import json
import re
import sys

import jax
import numpy as np
import pytest

import parallax as px
from tests.distributed.launching import run_launcher
from tests.distributed.launching import test_env as launch_env

from .tf_testing import GLOBAL_BATCH, launched_workers, train_mirrored

PER_FILE = 16
WORKERS, REPLICAS = 2, 2  # per worker; mini-batches of GLOBAL_BATCH / 4 = 8 rows
# case -> (policy, files, train): FILE over 5 files: worker 0 reads 3, worker 1 reads 2
# (training is checked for DATA and the uneven FILE; FILE, OFF and HINT check the rows).
CASES = {"DATA": ("DATA", (0, 1, 2, 3), True), "FILE": ("FILE", (0, 1, 2, 3), False),
         "FILE5": ("FILE", (0, 1, 2, 3, 4), True), "OFF": ("OFF", (0, 1, 2, 3), False),
         "HINT": ("HINT", (0, 1, 2, 3), False)}


def read_file(f):
    """File ``f``'s 16 examples: features [8] (row id in column 0) and a label."""
    rng = np.random.default_rng(f)
    x = rng.standard_normal((PER_FILE, 8)).astype(np.float32)
    x[:, 0] = 100 * f + np.arange(PER_FILE)
    return [(x[i], np.int32(rng.integers(0, 4))) for i in range(PER_FILE)]


def dataset_of(policy, files):
    options = px.tf.DatasetOptions(auto_shard_policy=policy)
    if policy == "HINT":  # one pipeline of examples with the placeholder shard
        examples = [e for f in files for e in read_file(f)]
        dataset = px.tf.Dataset.from_iterable(examples).shard(px.tf.SHARD_HINT, px.tf.SHARD_HINT)
    else:
        dataset = px.tf.Dataset.from_files(files, read_file)
    return dataset.batch(GLOBAL_BATCH).with_options(options)


def tensorflows_rows(policy, files, worker):
    """Each step's rows per replica of ``worker``, TensorFlow's rule written out plainly."""
    size = GLOBAL_BATCH // (WORKERS * REPLICAS)
    everything = [e for f in files for e in read_file(f)]
    if policy == "DATA":  # each batch of 32 -> 4 mini-batches of 8; keep those i % W == k
        minibatches = [everything[i:i + size] for i in range(0, len(everything), size)]
        mine = [mb for i, mb in enumerate(minibatches) if i % WORKERS == worker]
    else:  # the worker's own stream, batched by 32, rebatched into mini-batches of 8
        stream = {"FILE": [e for f in files[worker::WORKERS] for e in read_file(f)],
                  "OFF": everything, "HINT": everything[worker::WORKERS]}[policy]
        mine = [stream[i:i + size] for i in range(0, len(stream), size)]
    return [[np.stack([x for x, _ in mb]) for mb in mine[s:s + REPLICAS]]
            for s in range(0, len(mine), REPLICAS)]


def global_batches(policy, files):
    """The global batch of each step: every worker's rows of that step, in worker order."""
    by_worker = [tensorflows_rows(policy, files, k) for k in range(WORKERS)]
    labels = {float(x[0]): y for f in files for x, y in read_file(f)}
    out = []
    for step in range(max(map(len, by_worker))):
        x = np.concatenate([mb for rows in by_worker if step < len(rows) for mb in rows[step]])
        out.append((x, np.asarray([labels[float(v)] for v in x[:, 0]], np.int32)))
    return out


@pytest.mark.multiprocess
@pytest.mark.slow
def test_auto_sharding_over_two_workers():
    workers = launched_workers("auto_shard.py")
    assert [w["rank"] for w in workers] == [0, 1]
    steps = {"DATA": 2, "FILE": 2, "FILE5": 3, "OFF": 4, "HINT": 2}
    for case, (policy, files, train) in CASES.items():
        for k, w in enumerate(workers):
            want = tensorflows_rows(policy, files, k)
            got = w[case]["rows"]
            assert len(got) == steps[case], case
            for step, got_step in enumerate(got):
                want_step = want[step] if step < len(want) else []
                # TF: a replica without data gets an empty batch while others have data.
                want_step = want_step + [np.zeros((0, 8), np.float32)] * (
                    REPLICAS - len(want_step))
                for g, t in zip(got_step, want_step, strict=True):
                    np.testing.assert_array_equal(np.asarray(g, np.float32).reshape(t.shape), t)
        if case == "FILE5":  # the last step: worker 0's two mini-batches, worker 1 empty
            assert workers[0][case]["counts"][-1] == [8, 8, 0, 0]
        if not train:
            continue
        # The one-process run over the same global batches: MirroredStrategy on 4 devices.
        losses, state, _ = train_mirrored(px.tf.MirroredStrategy(devices=[0, 1, 2, 3]),
                                          batch_norm=False, data=global_batches(policy, files))
        ref = {jax.tree_util.keystr(p): np.asarray(x)
               for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}
        for w in workers:
            assert px.testing.relative_difference(w[case]["losses"], losses) <= 1e-5, case
            assert px.testing.relative_difference(
                [np.asarray(w[case]["state"][k]) for k in sorted(ref)],
                [ref[k] for k in sorted(ref)]) <= 1e-5, case
