"""Launched with 2 processes x 2 devices: TensorFlow's loop on MultiWorkerMirroredStrategy.

    parallax launch -np 2 --devices-per-process 2 python tests/tf/programs/multi_worker.py

Each worker runs the custom-training loop of ``tests/tf/tf_testing.py`` (with BatchNorm and
the accuracy metric) on the strategy's 4 replicas, every worker iterating the same global
batches and feeding only its own replicas' rows. Prints one JSON line per worker: its rank,
the local replica count, the losses, the accuracy and the final model state (its local
copy), which the test compares with the one-process run on 4 devices.
"""

import json

import parallax as px

strategy = px.tf.MultiWorkerMirroredStrategy()  # first: joins the job

import jax  # noqa: E402
import numpy as np  # noqa: E402

from tests.tf.tf_testing import train_mirrored  # noqa: E402

losses, state, accuracy = train_mirrored(strategy, batch_norm=True)
local_state = {jax.tree_util.keystr(path): np.asarray(leaf.addressable_data(0)).tolist()
               for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]}
print("RESULT " + json.dumps({
    "rank": jax.process_index(), "workers": jax.process_count(),
    "replicas": strategy.num_replicas_in_sync, "local": strategy.num_local_replicas,
    "axes": list(strategy.replica_axes), "losses": losses, "accuracy": accuracy,
    "state": local_state}))
px.distributed.shutdown()
