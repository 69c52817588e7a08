"""Launched with 2 processes x 2 devices: auto-sharding on MultiWorkerMirroredStrategy.

    parallax launch -np 2 --devices-per-process 2 python tests/tf/programs/auto_shard.py

Files of 16 examples, global batch 32 over 4 replicas (``tests/tf/test_multi_worker_input.py``
names the cases). For DATA, FILE and FILE over five files (one worker reads a file more),
every worker trains TensorFlow's custom loop (``tests/tf/tf_testing.py``) on its
``px.tf.Dataset``; for OFF and HINT it only iterates. It prints one JSON line: per case, the
rows its replicas received each step (and every replica's true row count), the losses and
its copy of the final parameters, which the test compares with TensorFlow's assignment and
with the one-process run over the same global batches.
"""

import json

import parallax as px

strategy = px.tf.MultiWorkerMirroredStrategy()  # first: joins the job

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from tests.tf import tf_testing  # noqa: E402
from tests.tf.test_multi_worker_input import CASES, dataset_of  # noqa: E402

result = {"rank": jax.process_index()}
for case, (policy, files, train) in CASES.items():
    with strategy.scope():
        model, optimizer, metric = tf_testing.objects(batch_norm=False)
    rows, counts, losses = [], [], []
    for batch in strategy.experimental_distribute_dataset(dataset_of(policy, files),
                                                          px.tf.InputOptions()):
        rows.append([np.asarray(x).tolist() for x, _ in strategy.experimental_local_results(batch)])
        counts.append(batch[0].rows)
        if train:
            per_replica = strategy.run(tf_testing.train_step,
                                       args=(model, optimizer, metric, batch))
            losses.append(float(strategy.reduce("SUM", per_replica, axis=None)))
    state = {jax.tree_util.keystr(p): np.asarray(leaf.addressable_data(0)).tolist()
             for p, leaf in jax.tree_util.tree_flatten_with_path(nnx.state(model))[0]}
    result[case] = {"rows": rows, "counts": counts, "losses": losses, "state": state}
print("RESULT " + json.dumps(result))
px.distributed.shutdown()
