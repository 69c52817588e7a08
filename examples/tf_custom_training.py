"""TensorFlow's custom-training tutorial, on ``px.tf.MirroredStrategy``.

    python examples/tf_custom_training.py --steps 40
    python examples/tf_custom_training.py --cross-device-ops nccl --check

The loop is the one of TensorFlow's guide "Custom training with tf.distribute.Strategy":
a strategy, a model, optimizer and metrics created in ``strategy.scope()``, a distributed
dataset, a per-example loss averaged over the *global* batch with
``px.tf.compute_average_loss``, ``strategy.run`` of the replica step, and
``strategy.reduce`` of the per-replica losses. The differences a JAX program needs: the
model, optimizer and metrics are passed to ``run`` (JAX traces pure functions) and the
gradients are all-reduced in the replica step (TF's ``optimizer.apply_gradients`` does it
implicitly). The data are a synthetic 10-class problem (no download). ``--check`` trains
the same model on one device and prints the largest difference. Without an accelerator it
simulates 8 CPU devices.
"""

from __future__ import annotations

import argparse

from parallax.cli import simulate_cpu_devices

OPS = ("collective", "nccl", "hierarchical", "reduce-to-one")


def synthetic_data(steps: int, batch: int, seed: int = 0):
    """``steps`` batches of 28x28 "images" of 10 classes: noisy class prototypes."""
    import numpy as np

    rng = np.random.default_rng(seed)
    prototypes = np.random.default_rng(1234).standard_normal((10, 28 * 28)).astype(np.float32)
    out = []
    for _ in range(steps):
        labels = rng.integers(0, 10, batch).astype(np.int32)
        images = prototypes[labels] + 2.0 * rng.standard_normal((batch, 28 * 28))
        out.append((images.astype(np.float32).reshape(batch, 28, 28), labels))
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="training steps")
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    parser.add_argument("--epochs", type=int, default=2, help="the steps are split into these")
    parser.add_argument("--cross-device-ops", choices=OPS, default="collective")
    parser.add_argument("--check", action="store_true",
                        help="also train on one device and compare the losses")
    args = parser.parse_args(argv)
    print(simulate_cpu_devices(8))

    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import parallax as px

    ops = {"collective": px.tf.CollectiveAllReduce(), "nccl": px.tf.NcclAllReduce(),
           "hierarchical": px.tf.HierarchicalCopyAllReduce(),
           "reduce-to-one": px.tf.ReductionToOneDevice()}[args.cross_device_ops]
    strategy = px.tf.MirroredStrategy(cross_device_ops=ops)
    print(f"Number of devices: {strategy.num_replicas_in_sync} ({ops})")
    global_batch = args.batch

    class Classifier(nnx.Module):
        def __init__(self, *, rngs):
            self.hidden = nnx.Linear(28 * 28, 128, use_bias=False, rngs=rngs)
            self.norm = nnx.BatchNorm(128, axis_name=strategy.replica_axes, rngs=rngs)
            self.out = nnx.Linear(128, 10, rngs=rngs)

        def __call__(self, images):
            hidden = self.norm(self.hidden(images.reshape(images.shape[0], -1)))
            return self.out(jax.nn.relu(hidden))

    def compute_loss(labels, logits):
        per_example_loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        return px.tf.compute_average_loss(per_example_loss, global_batch_size=global_batch)

    def train_step(model, optimizer, train_accuracy, inputs):
        images, labels = inputs

        def loss_fn(model):
            logits = model(images)
            return compute_loss(labels, logits), logits

        (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        grads = px.tf.get_replica_context().all_reduce(px.tf.ReduceOp.SUM, grads)
        optimizer.update(model, grads)
        train_accuracy.update(logits=logits, labels=labels)
        return loss

    with strategy.scope():
        model = Classifier(rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(0.05, momentum=0.9), wrt=nnx.Param)
        train_accuracy = nnx.metrics.Accuracy()

    data = synthetic_data(args.steps, global_batch)
    per_epoch = max(1, args.steps // args.epochs)
    losses = []
    for epoch in range(args.epochs):
        epoch_data = data[epoch * per_epoch:(epoch + 1) * per_epoch]
        if not epoch_data:
            break
        total_loss, batches = 0.0, 0
        for batch in strategy.experimental_distribute_dataset(epoch_data):
            per_replica_losses = strategy.run(
                train_step, args=(model, optimizer, train_accuracy, batch))
            loss = strategy.reduce(px.tf.ReduceOp.SUM, per_replica_losses, axis=None)
            losses.append(float(loss))
            total_loss, batches = total_loss + losses[-1], batches + 1
        print(f"Epoch {epoch + 1}, Loss: {total_loss / batches:.4f}, "
              f"Accuracy: {100 * float(train_accuracy.compute()):.2f}")
        train_accuracy.reset()

    result = {"losses": losses}
    if args.check:
        # The same step on one device: the replica context is the default one (1 replica),
        # so the all-reduce is the identity and BatchNorm's axis is left out.
        reference = Classifier(rngs=nnx.Rngs(0))
        reference.norm.axis_name = None
        ref_optimizer = nnx.Optimizer(reference, optax.sgd(0.05, momentum=0.9), wrt=nnx.Param)
        step = nnx.jit(train_step)
        ref_losses = [float(step(reference, ref_optimizer, nnx.metrics.Accuracy(),
                                 (jnp.asarray(x), jnp.asarray(y))))
                      for x, y in data[:len(losses)]]
        result["difference"] = px.testing.relative_difference(losses, ref_losses)
        print(f"one device: largest relative loss difference {result['difference']:.1e}")
    return result


if __name__ == "__main__":
    main()
