"""The TensorFlow original of examples/ported/tf_parameter_server_training.py.

Parameter-server training shaped as TensorFlow's tutorial ("Parameter server training with
ParameterServerStrategy", custom training loop): variables created under
``strategy.scope()``, a per-worker dataset, a scheduled step that calls ``strategy.run``
and ``strategy.reduce``, ``join`` and ``fetch``. docs/porting.md shows it line by line
beside its port; tests/tf/test_parameter_server_port.py runs it, where TensorFlow is
installed, on TensorFlow's own servers (tf_cluster.py) and compares the numbers.
"""

import argparse
import json
import os

import numpy as np
import tensorflow as tf

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--num-workers", type=int, default=1)
parser.add_argument("--num-ps", type=int, default=2)
parser.add_argument("--partitioner", choices=["fixed", "min_size", "none"], default="fixed")
args = parser.parse_args()

FEATURES, CLASSES, EXAMPLES, GLOBAL_BATCH_SIZE = 6, 3, 64, 16
os.environ.setdefault("TF_CONFIG", json.dumps({
    "cluster": {"chief": ["localhost:2222"],
                "worker": [f"localhost:{2223 + i}" for i in range(args.num_workers)],
                "ps": [f"localhost:{2300 + i}" for i in range(args.num_ps)]},
    "task": {"type": "chief", "index": 0}}))

cluster_resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
if cluster_resolver.task_type in ("worker", "ps"):
    server = tf.distribute.Server(
        cluster_resolver.cluster_spec(), job_name=cluster_resolver.task_type,
        task_index=cluster_resolver.task_id, protocol=cluster_resolver.rpc_layer or "grpc",
        start=True)
    server.join()

variable_partitioner = {
    "fixed": tf.distribute.experimental.partitioners.FixedShardsPartitioner(args.num_ps),
    "min_size": tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=16, max_shards=args.num_ps),
    "none": None}[args.partitioner]
strategy = tf.distribute.experimental.ParameterServerStrategy(
    cluster_resolver, variable_partitioner=variable_partitioner)

with strategy.scope():
    initial = np.random.default_rng(0).standard_normal((FEATURES, CLASSES)).astype(np.float32)
    w = tf.Variable(initial * 0.1, name="w")
    b = tf.Variable(tf.zeros([CLASSES]), name="b")
    optimizer = tf.keras.optimizers.SGD(learning_rate=0.1)


def shards(variable):  # TensorFlow's tape differentiates a sharded variable's parts
    return list(getattr(variable, "variables", [variable]))


def dataset_fn(input_context):
    batch_size = input_context.get_per_replica_batch_size(GLOBAL_BATCH_SIZE)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((EXAMPLES, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, EXAMPLES).astype(np.int32)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(batch_size)
    return dataset


@tf.function
def per_worker_dataset_fn():
    return strategy.distribute_datasets_from_function(dataset_fn)


coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
per_worker_dataset = coordinator.create_per_worker_dataset(per_worker_dataset_fn)
per_worker_iterator = iter(per_worker_dataset)


@tf.function
def step_fn(iterator):

    def replica_fn(x, y):
        with tf.GradientTape() as tape:
            logits = tf.matmul(x, w) + b
            per_example_loss = tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits)
            loss = tf.nn.compute_average_loss(per_example_loss)
        trainable = shards(w) + shards(b)
        gradients = tape.gradient(loss, trainable)
        optimizer.apply_gradients(zip(gradients, trainable))
        return loss

    x, y = next(iterator)
    losses = strategy.run(replica_fn, args=(x, y))
    return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)


losses = [coordinator.schedule(step_fn, args=(per_worker_iterator,))
          for _ in range(args.steps)]
coordinator.join()
print("losses", [float(loss.fetch()) for loss in losses])
print("replicas", strategy.num_replicas_in_sync, strategy.extended.worker_devices,
      strategy.extended.parameter_devices)
print("w on", [v.device for v in shards(w)], "b on", [v.device for v in shards(b)])
print("w", w.numpy().tolist())
print("b", tf.convert_to_tensor(b).numpy().tolist())
