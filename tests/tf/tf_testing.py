"""The custom-training loop of TensorFlow's tutorial, shared by the ``parallax.tf`` tests.

``train_step`` is written once, as a TensorFlow user writes it (per-example loss,
``compute_average_loss``, gradients all-reduced in the replica context, an optimizer update,
a metric), and runs either on one device (the default replica context, where the
all-reduce is the identity) or under a strategy's ``run``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import parallax as px

GLOBAL_BATCH = 32
STEPS = 5


class Net(nnx.Module):
    """A small classifier; with ``batch_norm`` a BatchNorm between the two layers.

    ``bn_axes``: the replica axes BatchNorm averages its batch statistics over
    (synchronized BatchNorm); ``None`` on one device.
    """

    def __init__(self, batch_norm: bool = False, bn_axes=None, *, rngs):
        # No bias before BatchNorm: it would cancel it, leaving a gradient of pure rounding.
        self.hidden = nnx.Linear(8, 16, use_bias=not batch_norm, rngs=rngs)
        self.norm = nnx.BatchNorm(16, axis_name=bn_axes, rngs=rngs) if batch_norm else None
        self.out = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        h = self.hidden(x)
        if self.norm is not None:
            h = self.norm(h)
        return self.out(jax.nn.relu(h))


def dataset(steps=STEPS, batch=GLOBAL_BATCH):
    rng = np.random.default_rng(0)
    return [(rng.standard_normal((batch, 8), np.float32),
             rng.integers(0, 4, batch).astype(np.int32)) for _ in range(steps)]


def train_step(model, optimizer, metric, inputs):
    features, labels = inputs

    def loss_fn(model):
        logits = model(features)
        per_example_loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        loss = px.tf.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH)
        return loss, logits

    (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    grads = px.tf.get_replica_context().all_reduce(px.tf.ReduceOp.SUM, grads)
    optimizer.update(model, grads)
    metric.update(logits=logits, labels=labels)
    return loss


def objects(batch_norm, bn_axes=None):
    model = Net(batch_norm, bn_axes, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)
    return model, optimizer, nnx.metrics.Accuracy()


def train_one_device(batch_norm, data=None):
    """The reference: the same step on one device, jitted (``nnx.jit``)."""
    model, optimizer, metric = objects(batch_norm)
    step = nnx.jit(train_step)
    losses = [float(step(model, optimizer, metric, (jnp.asarray(x), jnp.asarray(y))))
              for x, y in (data or dataset())]
    return losses, nnx.state(model), float(metric.compute())


def train_mirrored(strategy, batch_norm, data=None):
    """TensorFlow's loop: objects made in scope(), run per step, reduce the losses."""
    with strategy.scope():
        model, optimizer, metric = objects(batch_norm, strategy.replica_axes)
    losses = []
    for batch in strategy.experimental_distribute_dataset(data or dataset()):
        per_replica_losses = strategy.run(train_step, args=(model, optimizer, metric, batch))
        losses.append(float(strategy.reduce(px.tf.ReduceOp.SUM, per_replica_losses, axis=None)))
    return losses, nnx.state(model), float(metric.compute())


def launched_workers(program: str) -> list[dict]:
    """Runs ``tests/tf/programs/<program>`` under ``parallax launch -np 2`` (two devices per
    process); every worker's ``RESULT`` line, parsed, in rank order."""
    import json
    import re
    import sys

    from tests.distributed.launching import run_launcher
    from tests.distributed.launching import test_env as launch_env

    result = run_launcher(
        ["-np", "2", "--devices-per-process", "2", sys.executable,
         f"tests/tf/programs/{program}"],
        env=launch_env(JAX_DEFAULT_MATMUL_PRECISION="highest"))
    assert result.returncode == 0, result.stderr[-3000:]
    return sorted((json.loads(line) for line in re.findall(r"^\[\d\] RESULT (.*)$",
                                                           result.stdout, re.M)),
                  key=lambda w: w["rank"])
