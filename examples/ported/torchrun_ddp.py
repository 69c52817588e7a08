"""PyTorch's torchrun DDP tutorial script, ported to JAX with parallax, line for line.

    parallax launch --nproc-per-node 2 examples/ported/torchrun_ddp.py 2 1
    parallax launch --nproc-per-node 2 examples/ported/torchrun_ddp.py 2 1 --check
    python examples/ported/torchrun_ddp.py 2 1                 # alone: 8 simulated devices

The original is ``distributed/ddp-tutorial-series/multigpu_torchrun.py`` of pytorch/examples
(started as ``torchrun --nproc_per_node=2 multigpu_torchrun.py 50 10``): ``ddp_setup`` joins
the process group from torchrun's environment, a ``Trainer`` holds the model wrapped in
``DistributedDataParallel``, a ``DataLoader`` over a ``DistributedSampler`` (``set_epoch``
every epoch), ``loss.backward()`` / ``optimizer.step()`` per batch, and a snapshot saved
every ``save_every`` epochs (and loaded at start when it exists). The port keeps that
structure. What changes:

- ``ddp_setup``: ``px.distributed.initialize()`` reads the same variables (``parallax
  launch`` exports torchrun's ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ...); there is no
  ``torch.cuda.set_device``: a process uses the devices the launcher gives it.
- ``DDP(model)``: the model and optimizer state placed by ``px.init`` with
  ``px.DataParallel("data")`` on a mesh of every device of every process, and the batch step
  compiled by ``px.train_step``: the gradient all-reduce is in the program, not in autograd
  hooks (so no ``find_unused_parameters``, no ``model.module``).
- ``loss.backward(); optimizer.step()``: ``px.value_and_grad`` then ``state.apply_gradients``
  (a new state: JAX arrays are values, so ``zero_grad`` has nothing to clear).
- ``DistributedSampler``: :class:`DistributedSampler` below, the same index arithmetic
  (``torch/utils/data/distributed.py``: a permutation seeded by ``seed + epoch``, padded to a
  multiple of the number of replicas, rank ``r`` taking every ``num_replicas``-th index from
  ``r``), with NumPy's generator instead of ``torch.randperm`` (so not torch's exact order).
  A replica is a process, as in DDP with one GPU per process.
- The loss: the tutorial applies ``F.cross_entropy`` to the single output of
  ``Linear(20, 1)`` with float targets, which is identically zero (a softmax over one
  class) and trains nothing; the port uses the mean squared error the data set is made for.
- Snapshots go through ``px.checkpoint`` (Orbax), which every process calls: Orbax
  coordinates the processes and its primary process commits; ``torch.save`` on local rank 0
  becomes "save on every process, print on rank 0".

``--check`` also runs the same epochs as one plain ``jax.jit`` loop on one device (the
ranks' batches of each step concatenated) and compares losses and parameters, exiting 1 on
a mismatch (relative difference > 1e-5). ``docs/porting.md`` puts the two scripts side by
side.

References:
  pytorch/examples, ``distributed/ddp-tutorial-series/multigpu_torchrun.py`` and
  ``datautils.py``; PyTorch ``torch.utils.data.distributed.DistributedSampler``; Li et al.,
  "PyTorch Distributed: Experiences on Accelerating Data Parallel Training", VLDB 2020.
"""

from __future__ import annotations

import argparse
import math
import os
import sys


class MyTrainDataset:
    """``size`` pairs ``(x in [0, 1)^20, y in [0, 1))``, as the tutorial's ``datautils.py``.

    The tutorial's targets are independent of the inputs; here ``y`` is a fixed linear map
    of ``x`` plus noise, so that the loss falls and the comparison means something.
    """

    def __init__(self, size: int, seed: int = 0):
        import numpy as np

        rng = np.random.default_rng(seed)
        self.size = size
        self.x = rng.random((size, 20), dtype=np.float32)
        w = rng.standard_normal((20, 1)).astype(np.float32)
        self.y = (self.x @ w / 4 + 0.1 * rng.standard_normal((size, 1))).astype(np.float32)

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return self.x[index], self.y[index]


class DistributedSampler:
    """Which indices each replica (process) reads in an epoch: torch's arithmetic.

    Every process draws the same permutation (seeded by ``seed + epoch``), pads it to a
    multiple of ``num_replicas`` with its first indices, and keeps every ``num_replicas``-th
    index starting at its rank, so the replicas read disjoint rows of equal count.
    """

    def __init__(self, dataset, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0):
        import jax

        self.dataset, self.shuffle, self.seed, self.epoch = dataset, shuffle, seed, 0
        self.num_replicas = jax.process_count() if num_replicas is None else num_replicas
        self.rank = jax.process_index() if rank is None else rank
        self.num_samples = math.ceil(len(dataset) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self):
        import numpy as np

        if self.shuffle:
            indices = np.random.default_rng(self.seed + self.epoch).permutation(len(self.dataset))
        else:
            indices = np.arange(len(self.dataset))
        padding = self.total_size - len(indices)
        indices = np.concatenate([indices, np.resize(indices, padding)])
        return iter(indices[self.rank:self.total_size:self.num_replicas].tolist())

    def __len__(self):
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


class DataLoader:
    """Batches of ``batch_size`` rows in the sampler's order, as numpy ``(source, targets)``."""

    def __init__(self, dataset, batch_size: int, sampler):
        self.dataset, self.batch_size, self.sampler = dataset, batch_size, sampler

    def __iter__(self):
        order = list(self.sampler)
        for start in range(0, len(order), self.batch_size):
            yield self.dataset[order[start:start + self.batch_size]]

    def __len__(self):
        return math.ceil(len(self.sampler) / self.batch_size)


def ddp_setup():
    import parallax as px

    px.distributed.initialize()  # torchrun's / parallax launch's environment; gloo on CPU


class Trainer:
    def __init__(self, make_state, train_data: DataLoader, save_every: int,
                 snapshot_path: str) -> None:
        import parallax as px

        self.gpu_id = int(os.environ.get("LOCAL_RANK", 0))
        self.mesh, self.strategy = px.make_mesh(data=-1), px.DataParallel("data")  # "DDP"
        self.make_state = make_state
        self.state = px.init(make_state, self.mesh, self.strategy)
        self.train_data = train_data
        self.save_every = save_every
        self.epochs_run = 0
        self.snapshot_path = os.path.abspath(snapshot_path)
        self.losses: list[float] = []
        if os.path.exists(snapshot_path):
            print("Loading snapshot")
            self._load_snapshot(snapshot_path)
        self.step = px.train_step(self.mesh, self.strategy)(self._run_batch)

    def _load_snapshot(self, snapshot_path):
        import parallax as px

        snapshot = px.checkpoint.restore(self.snapshot_path, like=self.make_state,
                                         mesh=self.mesh, strategy=self.strategy)
        self.state = snapshot.state
        self.epochs_run = snapshot.extra["EPOCHS_RUN"] + 1
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}")

    @staticmethod
    def _run_batch(state, batch):
        import parallax as px

        loss, grads = px.value_and_grad(px.models.mse_loss)(state.model, batch)  # backward
        return state.apply_gradients(grads), {"loss": loss}                     # step

    def _run_epoch(self, epoch):
        import parallax as px

        b_sz = self.train_data.batch_size
        print(f"[GPU{self.gpu_id}] Epoch {epoch} | Batchsize: {b_sz} | "
              f"Steps: {len(self.train_data)}", flush=True)
        self.train_data.sampler.set_epoch(epoch)
        epoch_losses = []
        for source, targets in self.train_data:  # this process's rows; the step gathers them
            self.state, metrics = self.step(self.state, {"x": source, "y": targets})
            epoch_losses.append(float(metrics["loss"]))
        self.losses += epoch_losses
        if px.distributed.is_chief():
            print(f"Epoch {epoch} | loss {sum(epoch_losses) / len(epoch_losses):.6f}",
                  flush=True)

    def _save_snapshot(self, epoch):
        import parallax as px

        px.checkpoint.save(self.snapshot_path, self.state, step=epoch,
                           extra={"EPOCHS_RUN": epoch})  # every process: Orbax commits once
        if self.gpu_id == 0:
            print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs: int):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if epoch % self.save_every == 0:
                self._save_snapshot(epoch)


def load_train_objs(dataset_size: int, lr: float):
    import optax
    from flax import nnx

    import parallax as px

    train_set = MyTrainDataset(dataset_size)  # load your dataset

    def make_state():  # load your model and optimizer
        return px.TrainState.create(nnx.Linear(20, 1, rngs=nnx.Rngs(0)), optax.sgd(lr))

    return train_set, make_state


def prepare_dataloader(dataset, batch_size: int):
    return DataLoader(dataset, batch_size=batch_size, sampler=DistributedSampler(dataset))


def one_device(start_state, dataset, batch_size: int, epochs: range, replicas: int):
    """The same epochs as one plain jax.jit loop: each step's rows of every replica together."""
    import jax
    import numpy as np
    from flax import nnx

    import parallax as px

    loaders = [DataLoader(dataset, batch_size, DistributedSampler(dataset, replicas, rank))
               for rank in range(replicas)]
    with jax.default_device(jax.local_devices()[0]):
        state = jax.device_put(start_state, jax.local_devices()[0])

        @jax.jit
        def step(state, batch):
            def loss_fn(params):
                return px.models.mse_loss(nnx.merge(state.graphdef, params, state.rest), batch)
            loss, grads = jax.value_and_grad(loss_fn)(state.params)
            return state.apply_gradients(grads), loss

        losses = []
        for epoch in epochs:
            for loader in loaders:
                loader.sampler.set_epoch(epoch)
            for parts in zip(*loaders):
                batch = {"x": np.concatenate([x for x, _ in parts]),
                         "y": np.concatenate([y for _, y in parts])}
                state, loss = step(state, batch)
                losses.append(float(loss))
    return losses, state.params


def main(save_every: int, total_epochs: int, batch_size: int, snapshot_path: str,
         dataset_size: int = 2048, lr: float = 1e-3, check: bool = False) -> int:
    ddp_setup()
    import jax

    import parallax as px

    dataset, make_state = load_train_objs(dataset_size, lr)
    train_data = prepare_dataloader(dataset, batch_size)
    trainer = Trainer(make_state, train_data, save_every, snapshot_path)
    first_epoch = trainer.epochs_run
    start_state = host_copy(trainer.state) if check else None  # the step donates the state
    trainer.train(total_epochs)
    status = 0
    if check:
        ref_losses, ref_params = one_device(start_state, dataset, batch_size,
                                            range(first_epoch, total_epochs), jax.process_count())
        gap = max(px.testing.relative_difference(trainer.losses, ref_losses),
                  px.testing.relative_difference(host_copy(trainer.state.params),
                                                 jax.device_get(ref_params)))
        print(f"rank {jax.process_index()}: DDP vs one device over "
              f"{len(ref_losses)} steps: max relative difference {gap:.1e}", flush=True)
        status = 0 if gap <= 1e-5 and len(trainer.losses) == len(ref_losses) else 1
    px.distributed.shutdown()  # destroy_process_group()
    return status


def host_copy(tree):
    """This process's copy of a replicated state, as numpy."""
    import jax
    import numpy as np

    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), tree)


def simulate_when_alone() -> None:
    """Alone (no launcher), 8 simulated CPU devices, as every example here does."""
    if "PARALLAX_NUM_PROCESSES" not in os.environ and "WORLD_SIZE" not in os.environ:
        from parallax.cli import simulate_cpu_devices

        print(simulate_cpu_devices(8))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to save a snapshot")
    parser.add_argument("--batch_size", default=32, type=int,
                        help="Input batch size on each device (default: 32)")
    parser.add_argument("--snapshot_path", default="snapshot",
                        help="checkpoint directory (torch: snapshot.pt)")
    parser.add_argument("--dataset_size", default=2048, type=int)
    parser.add_argument("--lr", default=1e-3, type=float)
    parser.add_argument("--check", action="store_true", help="compare with one device")
    args = parser.parse_args()
    simulate_when_alone()
    sys.exit(main(args.save_every, args.total_epochs, args.batch_size, args.snapshot_path,
                  args.dataset_size, args.lr, args.check))
