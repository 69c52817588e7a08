"""An elastic Horovod-style run (for test_elastic.py), launched with 2 processes x 2 devices:

    parallax launch -np 2 --devices-per-process 2 --max-restarts 1 [--min-np 1] \\
        python elastic_train.py OUT.npz [--checkpoint-dir DIR] [--hold-at STEP]

ZeRO 3 over every device there is (parameters, gradients and optimizer state sharded across
the processes, so a restart restores each process's shards), 6 steps of a fixed global batch
of 16 rows (each process loads its rows, however many processes there are), a commit every
2 steps. With
--hold-at, the first start waits before that step (its commits written) for the test to
kill a process. Process 0 writes the final parameters and the losses it saw to OUT.npz.
"""

import argparse
import os
import time

import parallax as px
import parallax.horovod as hvd

hvd.init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

STEPS, ROWS = 6, 16


def mlp_state():
    return px.TrainState.create(px.models.MLP(16, [64, 64], 16, rngs=nnx.Rngs(0)),
                                optax.adam(1e-2))


def data():
    rng = np.random.default_rng(0)
    return [{"x": rng.standard_normal((ROWS, 16), np.float32),
             "y": rng.standard_normal((ROWS, 16), np.float32)} for _ in range(STEPS)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--hold-at", type=int, default=None)
    args = parser.parse_args()
    attempt = int(os.environ.get("PARALLAX_RESTART", "0"))
    mesh, strategy = px.make_mesh(fsdp=-1), px.ZeRO(3, "fsdp")

    @px.train_step(mesh, strategy)
    def step(state, batch):
        loss, grads = px.value_and_grad(px.models.mse_loss)(state.model, batch)
        return state.apply_gradients(grads), {"loss": loss}

    state = hvd.elastic.State(px.init(mlp_state, mesh, strategy), like=mlp_state, mesh=mesh,
                              strategy=strategy, directory=args.checkpoint_dir,
                              checkpoint_every=2, step=0)
    losses = []

    @hvd.elastic.run
    def train(state):
        rows = px.distributed.process_slice(ROWS, mesh, strategy)  # per world size
        batches = data()
        while state.step < STEPS:
            if attempt == 0 and state.step + 1 == args.hold_at:
                state.wait()  # the commits so far are written
                memory = os.environ.get("PARALLAX_ELASTIC_MEMORY")
                if memory and hvd.rank() == 0:  # every process wrote its own shards
                    written = sorted(os.listdir(os.path.join(memory, "2", "state")))
                    print(f"commit 2 in {memory} holds "
                          f"{[n for n in written if n.startswith('ocdbt')]}", flush=True)
                print(f"rank {hvd.rank()} pid {os.getpid()} holding at step {state.step + 1}",
                      flush=True)
                while True:
                    time.sleep(0.1)  # until the test kills a process and the launcher the rest
            batch = jax.tree.map(lambda x: x[rows], batches[state.step])
            state.train_state, metrics = step(
                state.train_state, px.distributed.global_batch(batch, mesh, strategy))
            losses.append(float(metrics["loss"]))
            state.step += 1
            if state.step % 2 == 0:
                state.commit()

    train(state)
    params = [np.asarray(multihost_utils.process_allgather(leaf, tiled=True))  # whole arrays
              for leaf in jax.tree.leaves(state.train_state.params)]
    if hvd.rank() == 0:
        np.savez(args.out, losses=np.array(losses), processes=jax.process_count(),
                 **{f"p{i}": p for i, p in enumerate(params)})
    print(f"rank {hvd.rank()} done at step {state.step} on {jax.process_count()} processes",
          flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
