"""Horovod's TensorFlow 2 MNIST example, ported to JAX with parallax, line for line.

    parallax launch -np 2 python examples/ported/horovod_tensorflow2_mnist.py
    parallax launch -np 2 python examples/ported/horovod_tensorflow2_mnist.py --check
    python examples/ported/horovod_tensorflow2_mnist.py --steps 64      # alone: 8 ranks

The original is ``examples/tensorflow2/tensorflow2_mnist.py`` of horovod/horovod (started
as ``horovodrun -np 2 python tensorflow2_mnist.py``): ``hvd.init()``, a Keras CNN, Adam with
the learning rate scaled by ``hvd.size()``, a ``tf.function`` step whose
``hvd.DistributedGradientTape`` averages the gradients over the ranks, the variables and the
optimizer's slots broadcast from rank 0 *after the first step* (so that the optimizer's
state exists), ``10000 // hvd.size()`` steps, rank 0 printing every 10 steps and saving the
checkpoint. The port keeps that structure. What changes:

- The data: a synthetic MNIST-shaped set (28x28x1 images of 10 noisy class prototypes), no
  download; each rank shuffles it with its own seed, as each Horovod rank's
  ``dataset.shuffle`` does with its own randomness.
- The model: a small Flax NNX CNN (conv, conv, max-pool, dense, dense) in place of the Keras
  ``Sequential`` (narrower, and without the two ``Dropout`` layers, so that ``--check`` can
  compare exactly).
- ``tf.function`` -> ``@hvd.jit``: the step is written for one rank and runs as one program
  over every rank. TensorFlow traces the step once per Python value of ``first_batch``;
  here it is one program per value too (:func:`make_steps`).
- ``hvd.DistributedGradientTape(tape)`` + ``tape.gradient`` -> ``jax.grad`` then
  ``hvd.allreduce(grads)`` (an average over the ranks: what the tape does).
  ``hvd.DistributedOptimizer(optax.adam(...))`` does the same inside the optimizer.
- ``hvd.broadcast_variables(model.variables / opt.variables(), root_rank=0)`` ->
  ``hvd.broadcast(params / opt_state, root_rank=0)`` inside the first step. Before it the
  ranks hold different parameters (each initialised with its own seed), which the first
  step receives as ``hvd.PerRank`` values.
- The loss printed is the average over the ranks (``hvd.allreduce(loss)``), not rank 0's
  own: ``@hvd.jit`` returns one replicated value per result.
- ``tf.train.Checkpoint`` -> ``px.checkpoint.Manager`` (Orbax; saves numbered 1, 2, ... as
  TensorFlow's), and ``checkpoint.save`` on rank 0 -> on every rank: a JAX checkpoint is a
  collective (each process writes its shards; Orbax's primary process, rank 0, commits).

``--check`` runs the same steps in one process on one device (each step the mean of every
rank's gradient, the first at every rank's own initial parameters, then rank 0's updated
parameters) and compares losses and parameters, exiting 1 on a relative difference over
1e-5. With K devices in a process (alone: 8), a rank is a device and the process's ranks
start from the same parameters. ``docs/porting.md`` puts the two scripts side by side.

References:
  horovod/horovod, ``examples/tensorflow2/tensorflow2_mnist.py``; Sergeev & Del Balso,
  "Horovod: fast and easy distributed deep learning in TensorFlow", 2018.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys


def load_data(size: int = 2048, seed: int = 0):
    """``size`` 28x28x1 images in [0, 1] of 10 classes: noisy prototypes, and their labels."""
    import numpy as np

    rng = np.random.default_rng(seed)
    prototypes = rng.random((10, 28, 28, 1))
    labels = rng.integers(0, 10, size)
    images = np.clip(prototypes[labels] + 0.3 * rng.standard_normal((size, 28, 28, 1)), 0, 1)
    return images.astype(np.float32), labels.astype(np.int32)


def dataset(images, labels, batch: int, seed: int):
    """``dataset.repeat().shuffle(...).batch(batch)``: a fresh permutation every epoch."""
    import numpy as np

    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(len(images))
        for start in range(0, len(order) - batch + 1, batch):
            rows = order[start:start + batch]
            yield images[rows], labels[rows]


def rank_batches(images, labels, batch: int, ranks, steps: int):
    """``steps`` batches for this process: each of its ranks' own batch, side by side."""
    import numpy as np

    streams = [dataset(images, labels, batch, seed=rank) for rank in ranks]
    for _ in range(steps):
        parts = [next(stream) for stream in streams]
        yield np.concatenate([x for x, _ in parts]), np.concatenate([y for _, y in parts])


def create_model(seed: int):
    from flax import nnx

    class MnistModel(nnx.Module):
        def __init__(self, rngs):
            self.conv1 = nnx.Conv(1, 8, (3, 3), padding="VALID", rngs=rngs)
            self.conv2 = nnx.Conv(8, 16, (3, 3), padding="VALID", rngs=rngs)
            self.dense1 = nnx.Linear(12 * 12 * 16, 32, rngs=rngs)
            self.dense2 = nnx.Linear(32, 10, rngs=rngs)

        def __call__(self, images):
            import jax

            x = jax.nn.relu(self.conv2(jax.nn.relu(self.conv1(images))))
            x = nnx.max_pool(x, (2, 2), strides=(2, 2))
            x = jax.nn.relu(self.dense1(x.reshape(x.shape[0], -1)))
            return jax.nn.log_softmax(self.dense2(x))  # Keras: softmax, then the loss's log

    return nnx.split(MnistModel(nnx.Rngs(seed)))


def sparse_categorical_crossentropy(labels, log_probs):
    import jax.numpy as jnp

    return -jnp.mean(jnp.take_along_axis(log_probs, labels[:, None], axis=1))


def make_steps(graphdef, opt):
    """The per-rank step, compiled once per value of ``first_batch`` (as tf.function traces)."""
    import jax
    import optax
    from flax import nnx

    import parallax.horovod as hvd

    def training_step(params, opt_state, images, labels, first_batch):
        if first_batch:  # each rank's own values (hvd.PerRank) until the broadcast below
            params, opt_state = params.value, opt_state.value

        def loss_fn(params):
            probs = nnx.merge(graphdef, params)(images)
            return sparse_categorical_crossentropy(labels, probs)

        loss_value, grads = jax.value_and_grad(loss_fn)(params)
        grads = hvd.allreduce(grads)  # Horovod: DistributedGradientTape averages the gradients
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)

        # Horovod: broadcast initial variable states from rank 0 to all other processes,
        # after the first gradient step (the optimizer's state exists from then on).
        if first_batch:
            params = hvd.broadcast(params, root_rank=0)
            opt_state = hvd.broadcast(opt_state, root_rank=0)

        return params, opt_state, hvd.allreduce(loss_value)

    return {first: hvd.jit(functools.partial(training_step, first_batch=first),
                           batch_argnums=(2, 3)) for first in (True, False)}


def one_process(graphdef, opt, starts, batches):
    """The reference on one device: each step the mean over every rank's gradient.

    Each rank's gradient is computed by the same jitted function, one rank at a time, at
    that rank's parameters (its own start for the first step, rank 0's afterwards).
    """
    import jax
    import optax
    from flax import nnx

    @jax.jit
    def grad(params, images, labels):
        def loss_fn(params):
            return sparse_categorical_crossentropy(labels, nnx.merge(graphdef, params)(images))
        return jax.value_and_grad(loss_fn)(params)

    @jax.jit
    def apply(params, opt_state, grads):
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    ranks = len(starts)
    with jax.default_device(jax.local_devices()[0]):
        rank_params, params = starts, starts[0]
        opt_state = opt.init(params)
        losses = []
        for images, labels in batches:
            per_rank = [grad(rank_params[r], *_rows(images, labels, r, ranks))
                        for r in range(ranks)]
            grads = jax.tree.map(lambda *g: sum(g) / ranks, *[g for _, g in per_rank])
            params, opt_state = apply(params, opt_state, grads)
            rank_params = [params] * ranks
            losses.append(sum(float(loss) for loss, _ in per_rank) / ranks)
    return losses, params


def _rows(images, labels, rank: int, ranks: int):
    """Rank ``rank``'s rows of a batch that holds every rank's rows side by side."""
    per_rank = len(images) // ranks
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    return images[rows], labels[rows]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10000,
                        help="steps of all ranks together (each rank runs steps // size)")
    parser.add_argument("--batch", type=int, default=128, help="batch per rank")
    parser.add_argument("--checkpoint-dir", default="./checkpoints")
    parser.add_argument("--check", action="store_true", help="compare with one process")
    args = parser.parse_args(argv)
    if "PARALLAX_NUM_PROCESSES" not in os.environ:
        from parallax.cli import simulate_cpu_devices

        print(simulate_cpu_devices(8))

    import parallax.horovod as hvd

    # Horovod: initialize Horovod.
    hvd.init()

    # Horovod: pin GPU to be used to process local rank: parallax launch gives each process
    # its devices; JAX uses only those.
    import jax
    import numpy as np
    import optax

    import parallax as px

    mnist_images, mnist_labels = load_data()
    local_ranks = range(hvd.rank(), hvd.rank() + jax.local_device_count())
    steps = args.steps // hvd.size()  # Horovod: adjust number of steps based on number of GPUs.
    data = rank_batches(mnist_images, mnist_labels, args.batch, local_ranks, steps)

    graphdef, params = create_model(seed=hvd.rank())  # each rank its own random start
    # Horovod: adjust learning rate based on number of GPUs.
    opt = optax.adam(0.001 * hvd.size())
    opt_state = opt.init(params)
    checkpoint_dir = os.path.abspath(args.checkpoint_dir)
    checkpoint = px.checkpoint.Manager(checkpoint_dir, async_save=False)
    save_number = (checkpoint.latest_step() or 0) + 1  # numbered as TF's ckpt-1, ckpt-2, ...
    training_step = make_steps(graphdef, opt)

    losses = []
    for batch, (images, labels) in enumerate(data):
        if batch == 0:  # until the first step's broadcast, each rank holds its own values
            params, opt_state = hvd.PerRank(params), hvd.PerRank(opt_state)
        params, opt_state, loss_value = training_step[batch == 0](params, opt_state,
                                                                  images, labels)
        losses.append(float(loss_value))
        if batch % 10 == 0 and hvd.rank() == 0:
            print("Step #%d\tLoss: %.6f" % (batch, loss_value), flush=True)

    # Horovod: save checkpoints only on worker 0. Here every rank takes part in the save and
    # rank 0 (Orbax's primary process) commits it.
    checkpoint.save(save_number, (params, opt_state))
    checkpoint.close()
    if hvd.rank() == 0:
        print(f"checkpoint saved at {checkpoint_dir}/{save_number}", flush=True)
    if not args.check:
        return 0
    per_process = jax.local_device_count()  # a process's ranks share its first rank's start
    starts = [create_model(seed=rank - rank % per_process)[1] for rank in range(hvd.size())]
    batches = rank_batches(mnist_images, mnist_labels, args.batch, range(hvd.size()), steps)
    ref_losses, ref_params = one_process(graphdef, opt, starts, batches)
    mine = jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), params)
    loss_gap = px.testing.relative_difference(np.asarray(losses), np.asarray(ref_losses))
    param_gap = px.testing.relative_difference(mine, jax.device_get(ref_params))
    gap = max(loss_gap, param_gap)
    print(f"rank {hvd.rank()}: {hvd.size()} ranks vs one process over {steps} steps: "
          f"max relative difference: losses {loss_gap:.1e}, parameters {param_gap:.1e}",
          flush=True)
    return 0 if gap <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
