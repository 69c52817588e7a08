"""TensorFlow's "Custom training with tf.distribute.Strategy" tutorial, on ``px.tf``, line for line.

    python examples/ported/tf_custom_training.py --epochs 4
    python examples/ported/tf_custom_training.py --cross-device-ops nccl --check

The original is ``site/en/tutorials/distribute/custom_training.ipynb`` of tensorflow/docs:
a ``MirroredStrategy``; ``GLOBAL_BATCH_SIZE = BATCH_SIZE_PER_REPLICA *
num_replicas_in_sync``; distributed train and test datasets; a CNN with L2 regularisers,
the loss object, the metrics, the optimizer and the checkpoint created in
``strategy.scope()``; ``compute_loss`` averaging the per-example loss over the *global*
batch and adding the regularisation scaled by the number of replicas; ``train_step`` and
``test_step`` run by ``strategy.run`` inside ``distributed_train_step`` (whose per-replica
losses ``strategy.reduce(SUM)`` adds) and ``distributed_test_step``; an epoch loop that
checkpoints every second epoch, prints the metrics and resets them; and at the end the
checkpoint restored into a new model *without* a strategy and evaluated. The port keeps that
structure. What changes:

- The data: a synthetic Fashion-MNIST-shaped set (28x28x1 images of 10 noisy class
  prototypes; no download); sizes that the global batch divides (a partial last batch works,
  see ``docs/tf.md``, but then the metrics need ``example_mask``).
- The model: Flax NNX layers (narrower than the tutorial's: 8 and 16 filters, 32 units); the
  L2 regulariser is computed from the kernels (Keras collects it in ``model.losses``).
- ``train_step(inputs)`` reads ``model``, ``optimizer`` and the metrics from its closure in
  TensorFlow; JAX traces pure functions, so they are passed to ``strategy.run`` in ``args``.
- ``optimizer.apply_gradients`` all-reduces the gradients implicitly in TensorFlow; here the
  replica step calls ``get_replica_context().all_reduce(SUM, grads)`` first.
- ``@tf.function`` around the distributed steps: ``strategy.run`` compiles the replica
  function itself (one program over every replica).
- ``tf.train.Checkpoint`` -> ``px.checkpoint.Manager`` (Orbax) of the model's and
  optimizer's state, its saves numbered 1, 2, ... as TensorFlow's.

``--check`` trains the same model on one device with the same global batches (the default
replica context: one replica, so the all-reduce is the identity) and compares the losses
and the final parameters, exiting 1 on a relative difference over 1e-5. Without an
accelerator the script simulates 8 CPU devices. ``docs/porting.md`` puts the two side by side.

References:
  tensorflow/docs, ``site/en/tutorials/distribute/custom_training.ipynb``; TensorFlow
  ``tf.distribute.MirroredStrategy``, ``tf.nn.compute_average_loss``,
  ``tf.nn.scale_regularization_loss``.
"""

from __future__ import annotations

import argparse
import os
import sys

from parallax.cli import simulate_cpu_devices

OPS = ("collective", "nccl", "hierarchical", "reduce-to-one")


def load_data(train_size: int, test_size: int, seed: int = 0):
    """``fashion_mnist.load_data()``'s shapes: 28x28 images in [0, 1], ``[..., None]``."""
    import numpy as np

    rng = np.random.default_rng(seed)
    prototypes = rng.random((10, 28, 28))

    def split(size):
        labels = rng.integers(0, 10, size)
        noise = 0.4 * rng.standard_normal((size, 28, 28))
        images = np.clip(prototypes[labels] + noise, 0, 1)[..., None]
        return images.astype(np.float32), labels.astype(np.int32)

    return split(train_size), split(test_size)


def batches(images, labels, batch: int, shuffle_seed: int | None = None):
    """``Dataset.from_tensor_slices(...)[.shuffle(BUFFER_SIZE)].batch(batch)``, one epoch."""
    import numpy as np

    order = (np.arange(len(images)) if shuffle_seed is None
             else np.random.default_rng(shuffle_seed).permutation(len(images)))
    return [(images[order[i:i + batch]], labels[order[i:i + batch]])
            for i in range(0, len(order), batch)]


def create_model(rngs):
    import jax
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.conv1 = nnx.Conv(1, 8, (3, 3), padding="VALID", rngs=rngs)
            self.conv2 = nnx.Conv(8, 16, (3, 3), padding="VALID", rngs=rngs)
            self.dense1 = nnx.Linear(5 * 5 * 16, 32, rngs=rngs)
            self.dense2 = nnx.Linear(32, 10, rngs=rngs)

        def __call__(self, x):
            x = nnx.max_pool(jax.nn.relu(self.conv1(x)), (2, 2), strides=(2, 2))
            x = nnx.max_pool(jax.nn.relu(self.conv2(x)), (2, 2), strides=(2, 2))
            x = jax.nn.relu(self.dense1(x.reshape(x.shape[0], -1)))
            return self.dense2(x)

        def losses(self):  # Keras' model.losses: kernel_regularizer=L2(1e-5) on every layer
            kernels = [self.conv1.kernel, self.conv2.kernel, self.dense1.kernel,
                       self.dense2.kernel]
            return [1e-5 * (k[...] ** 2).sum() for k in kernels]

    return Model(rngs)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-per-replica", type=int, default=64)
    parser.add_argument("--train-size", type=int, default=4096)
    parser.add_argument("--test-size", type=int, default=1024)
    parser.add_argument("--checkpoint-dir", default="./training_checkpoints")
    parser.add_argument("--cross-device-ops", choices=OPS, default="collective")
    parser.add_argument("--check", action="store_true",
                        help="also train on one device and compare losses and parameters")
    args = parser.parse_args(argv)
    print(simulate_cpu_devices(8))

    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import parallax as px

    (train_images, train_labels), (test_images, test_labels) = load_data(
        args.train_size, args.test_size)

    ops = {"collective": px.tf.CollectiveAllReduce(), "nccl": px.tf.NcclAllReduce(),
           "hierarchical": px.tf.HierarchicalCopyAllReduce(),
           "reduce-to-one": px.tf.ReductionToOneDevice()}[args.cross_device_ops]
    strategy = px.tf.MirroredStrategy(cross_device_ops=ops)
    print("Number of devices: {}".format(strategy.num_replicas_in_sync))

    BATCH_SIZE_PER_REPLICA = args.batch_per_replica
    GLOBAL_BATCH_SIZE = BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync
    EPOCHS = args.epochs

    train_batches = [batches(train_images, train_labels, GLOBAL_BATCH_SIZE, shuffle_seed=epoch)
                     for epoch in range(EPOCHS)]  # shuffle(BUFFER_SIZE): anew every epoch
    test_dataset = batches(test_images, test_labels, GLOBAL_BATCH_SIZE)
    test_dist_dataset = strategy.experimental_distribute_dataset(test_dataset)

    checkpoint_dir = os.path.abspath(args.checkpoint_dir)

    with strategy.scope():
        def loss_object(labels, predictions):  # from_logits=True, reduction=NONE
            return optax.softmax_cross_entropy_with_integer_labels(predictions, labels)

        def compute_loss(labels, predictions, model_losses):
            per_example_loss = loss_object(labels, predictions)
            loss = px.tf.compute_average_loss(per_example_loss,
                                              global_batch_size=GLOBAL_BATCH_SIZE)
            if model_losses:
                loss += px.tf.scale_regularization_loss(sum(model_losses))
            return loss

    with strategy.scope():
        test_loss = nnx.metrics.Average("loss")
        train_accuracy = nnx.metrics.Accuracy()
        test_accuracy = nnx.metrics.Accuracy()

    # A model, an optimizer, and a checkpoint must be created under `strategy.scope`.
    with strategy.scope():
        model = create_model(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

        checkpoint = px.checkpoint.Manager(checkpoint_dir, async_save=False)

    def train_step(model, optimizer, train_accuracy, inputs):
        images, labels = inputs

        def loss_fn(model):
            predictions = model(images)
            return compute_loss(labels, predictions, model.losses()), predictions

        (loss, predictions), gradients = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        gradients = px.tf.get_replica_context().all_reduce(px.tf.ReduceOp.SUM, gradients)
        optimizer.update(model, gradients)

        train_accuracy.update(logits=predictions, labels=labels)
        return loss

    def test_step(model, test_loss, test_accuracy, inputs):
        images, labels = inputs

        predictions = model(images)
        t_loss = loss_object(labels, predictions)

        test_loss.update(loss=t_loss)
        test_accuracy.update(logits=predictions, labels=labels)

    def distributed_train_step(dataset_inputs):
        per_replica_losses = strategy.run(
            train_step, args=(model, optimizer, train_accuracy, dataset_inputs))
        return strategy.reduce(px.tf.ReduceOp.SUM, per_replica_losses, axis=None)

    def distributed_test_step(dataset_inputs):
        return strategy.run(test_step, args=(model, test_loss, test_accuracy, dataset_inputs))

    losses = []
    for epoch in range(EPOCHS):
        # TRAIN LOOP
        total_loss = 0.0
        num_batches = 0
        for x in strategy.experimental_distribute_dataset(train_batches[epoch]):
            losses.append(float(distributed_train_step(x)))
            total_loss += losses[-1]
            num_batches += 1
        train_loss = total_loss / num_batches

        # TEST LOOP
        for x in test_dist_dataset:
            distributed_test_step(x)

        if epoch % 2 == 0:  # numbered 1, 2, ... as TF's checkpoint.save(checkpoint_prefix)
            checkpoint.save((checkpoint.latest_step() or 0) + 1,
                            (nnx.state(model), nnx.state(optimizer)))

        template = ("Epoch {}, Loss: {}, Accuracy: {}, Test Loss: {}, "
                    "Test Accuracy: {}")
        print(template.format(epoch + 1, train_loss,
                              float(train_accuracy.compute()) * 100, float(test_loss.compute()),
                              float(test_accuracy.compute()) * 100))

        test_loss.reset()
        train_accuracy.reset()
        test_accuracy.reset()

    # Restore the latest checkpoint into a new model, without a strategy, and evaluate it.
    eval_accuracy = nnx.metrics.Accuracy()
    new_model = create_model(nnx.Rngs(1))
    new_optimizer = nnx.Optimizer(new_model, optax.adam(1e-3), wrt=nnx.Param)
    restored = checkpoint.restore(like=(nnx.state(new_model), nnx.state(new_optimizer))).state
    checkpoint.close()
    nnx.update(new_model, restored[0])
    nnx.update(new_optimizer, restored[1])

    @nnx.jit
    def eval_step(new_model, eval_accuracy, images, labels):
        eval_accuracy.update(logits=new_model(images), labels=labels)

    for images, labels in test_dataset:
        eval_step(new_model, eval_accuracy, jnp.asarray(images), jnp.asarray(labels))
    print("Accuracy after restoring the saved model without strategy: {}".format(
        float(eval_accuracy.compute()) * 100))

    result = {"losses": losses}
    if args.check:
        # The same steps on one device: the replica context is the default one (1 replica),
        # so the all-reduce is the identity and the regularisation is not divided.
        reference = create_model(nnx.Rngs(0))
        ref_optimizer = nnx.Optimizer(reference, optax.adam(1e-3), wrt=nnx.Param)
        step = nnx.jit(train_step)
        ref_losses = [float(step(reference, ref_optimizer, nnx.metrics.Accuracy(),
                                 (jnp.asarray(x), jnp.asarray(y))))
                      for epoch_batches in train_batches for x, y in epoch_batches]
        result["difference"] = max(
            px.testing.relative_difference(losses, ref_losses),
            px.testing.relative_difference(jax.device_get(nnx.state(model, nnx.Param)),
                                           jax.device_get(nnx.state(reference, nnx.Param))))
        print(f"one device: largest relative difference (losses, parameters) "
              f"{result['difference']:.1e}")
    return result


if __name__ == "__main__":
    outcome = main()
    sys.exit(0 if outcome.get("difference", 0.0) <= 1e-5 else 1)
