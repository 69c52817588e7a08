"""TensorFlow's parameter-server training loop, ported to parallax.

The original is shaped as TensorFlow's tutorial "Parameter server training with
ParameterServerStrategy" (custom training loop): variables created under
``strategy.scope()``, a per-worker dataset, a scheduled step that calls ``strategy.run`` and
``strategy.reduce``, ``coordinator.join()`` and ``fetch``; tests/tf/programs/
tf_parameter_server_original.py is that script, and docs/porting.md shows the two line by
line. The port changes the imports (``tf.distribute.experimental.X`` -> ``px.tf.X``) and
what JAX itself forces:

- the gradient: JAX differentiates a function of arrays, so the loss is a pure function of
  the variables' values (read with ``np.asarray(v)``, TensorFlow's
  ``tf.convert_to_tensor``), compiled with ``jax.jit(jax.value_and_grad(...))`` where
  ``@tf.function`` compiled the whole step (reads and writes of server variables are side
  effects, which stay outside ``jax.jit``);
- the tensor library: ``jnp`` / ``optax`` for ``tf.*`` ops and Keras's SGD (run by the
  servers: ``px.tf.ServerOptimizer(optax.sgd(0.1))``), and a Python generator for
  ``tf.data`` (a ``tf.data`` pipeline also works where TensorFlow is installed: its
  elements arrive as numpy arrays).

Run it (a local Ray cluster on 127.0.0.1 plays the worker and ps tasks of ``TF_CONFIG``)::

    python examples/ported/tf_parameter_server_training.py --steps 10 --check

``--check`` (one worker) trains the same model on one device with ``jax.jit`` and exits
non-zero when a loss or a variable differs by more than 1e-5 relative.
"""

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax

import parallax as px

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--num-workers", type=int, default=1)
parser.add_argument("--num-ps", type=int, default=2)
parser.add_argument("--partitioner", choices=["fixed", "min_size", "none"], default="fixed")
parser.add_argument("--check", action="store_true", help="compare with one device (1 worker)")
args = parser.parse_args()

FEATURES, CLASSES, EXAMPLES, GLOBAL_BATCH_SIZE = 6, 3, 64, 16
os.environ.setdefault("TF_CONFIG", json.dumps({
    "cluster": {"chief": ["localhost:2222"],
                "worker": [f"localhost:{2223 + i}" for i in range(args.num_workers)],
                "ps": [f"localhost:{2300 + i}" for i in range(args.num_ps)]},
    "task": {"type": "chief", "index": 0}}))

cluster_resolver = px.tf.TFConfigClusterResolver()
if cluster_resolver.task_type in ("worker", "ps"):
    server = px.tf.Server(
        cluster_resolver.cluster_spec(), job_name=cluster_resolver.task_type,
        task_index=cluster_resolver.task_id, protocol=cluster_resolver.rpc_layer or "grpc",
        start=True)
    server.join()

variable_partitioner = {
    "fixed": px.tf.FixedShardsPartitioner(args.num_ps),
    "min_size": px.tf.MinSizePartitioner(
        min_shard_bytes=16, max_shards=args.num_ps),
    "none": None}[args.partitioner]
strategy = px.tf.ParameterServerStrategy(
    cluster_resolver, variable_partitioner=variable_partitioner)

with strategy.scope():
    initial = np.random.default_rng(0).standard_normal((FEATURES, CLASSES)).astype(np.float32)
    w = px.tf.Variable(initial * 0.1, name="w")
    b = px.tf.Variable(np.zeros([CLASSES], np.float32), name="b")
    optimizer = px.tf.ServerOptimizer(optax.sgd(learning_rate=0.1))


def repeat_batch(x, y, batch_size):  # tf.data's from_tensor_slices((x, y)).repeat().batch()
    for start in range(0, 2**62, batch_size):
        rows = np.arange(start, start + batch_size) % len(x)
        yield x[rows], y[rows]


def dataset_fn(input_context):
    batch_size = input_context.get_per_replica_batch_size(GLOBAL_BATCH_SIZE)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((EXAMPLES, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, EXAMPLES).astype(np.int32)
    dataset = repeat_batch(x, y, batch_size)
    return dataset


def per_worker_dataset_fn():
    return strategy.distribute_datasets_from_function(dataset_fn)


coordinator = px.tf.ClusterCoordinator(strategy)
per_worker_dataset = coordinator.create_per_worker_dataset(per_worker_dataset_fn)
per_worker_iterator = iter(per_worker_dataset)


@jax.jit
@jax.value_and_grad
def loss_and_gradients(trainable, x, y):
    w, b = trainable
    logits = jnp.matmul(x, w) + b
    per_example_loss = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    loss = px.tf.compute_average_loss(per_example_loss)
    return loss


def step_fn(iterator):

    def replica_fn(x, y):
        trainable = [w, b]
        loss, gradients = loss_and_gradients([np.asarray(v) for v in trainable], x, y)
        optimizer.apply_gradients(zip(gradients, trainable))
        return loss

    x, y = next(iterator)
    losses = strategy.run(replica_fn, args=(x, y))
    return strategy.reduce(px.tf.ReduceOp.SUM, losses, axis=None)


losses = [coordinator.schedule(step_fn, args=(per_worker_iterator,))
          for _ in range(args.steps)]
coordinator.join()
print("losses", [float(loss.fetch()) for loss in losses])
print("replicas", strategy.num_replicas_in_sync, strategy.extended.worker_devices,
      strategy.extended.parameter_devices)
print("w on", [v.device for v in w.variables], "b on", [v.device for v in b.variables])
print("w", w.numpy().tolist())
print("b", np.asarray(b).tolist())


def one_device(steps: int):
    """The same training on one device: jit(value_and_grad) and optax.sgd on whole arrays."""
    batches = dataset_fn(px.tf.InputContext())
    params, tx = [jnp.asarray(initial * 0.1), jnp.zeros(CLASSES)], optax.sgd(0.1)
    state, history = tx.init(params), []
    for _ in range(steps):
        loss, grads = loss_and_gradients(params, *next(batches))
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        history.append(float(loss))
    return history, params


if args.check:
    if args.num_workers != 1:
        raise SystemExit("--check compares one worker (functions in order) with one device.")
    want_losses, (want_w, want_b) = one_device(args.steps)
    got = np.array([float(loss.fetch()) for loss in losses])
    loss_error = float(np.max(np.abs(got - want_losses) / np.abs(want_losses)))
    variable_error = max(float(np.max(np.abs(np.asarray(v) - t)) / np.max(np.abs(t)))
                         for v, t in ((w, want_w), (b, want_b)))  # relative to its scale
    print(f"vs one process: losses {loss_error:.2g}, variables {variable_error:.2g} "
          f"(relative)")
    if max(loss_error, variable_error) > 1e-5:
        raise SystemExit(1)
