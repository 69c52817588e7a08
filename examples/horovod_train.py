"""A Horovod-style training script, on JAX: ``import parallax.horovod as hvd``.

    parallax launch -np 2 python examples/horovod_train.py --steps 20      # 2 ranks
    python examples/horovod_train.py --steps 20                            # alone (8 devices)
    parallax launch -np 2 python examples/horovod_train.py --check         # vs one process
    parallax launch -np 2 python examples/horovod_train.py --algorithm tree  # CPU clusters

The shape of every Horovod script: ``hvd.init()``; each rank starts from its own random
parameters (seeded by its rank, to show the broadcast), ``hvd.broadcast_parameters`` makes
them rank 0's; ``hvd.DistributedOptimizer`` wraps the optimizer; each rank reads only its
shard of the data (``rows[rank::size]`` in Horovod, a contiguous block here); rank 0 logs
(a progress bar with examples/s per device, MFU and memory, a table at the end, ``--logdir``
and ``--profile-steps`` as for ``parallax demo``).
The step is written for one rank and run by ``@hvd.jit`` over every device of every process.
The data are synthetic (a noisy linear teacher), so nothing is downloaded. ``--check`` runs
the same steps as one plain ``jax.jit`` program on the full batches and compares.
``--algorithm tree`` sums the gradient buckets with point-to-point exchanges instead of
XLA's all-reduce (faster across CPU processes over gloo; ``docs/distributed.md``).
"""

from __future__ import annotations

import argparse
import os
import sys


def teacher_data(steps: int, batch: int, features: int = 16, seed: int = 0):
    """``steps`` global batches of a noisy linear map with a tanh."""
    import numpy as np

    rng = np.random.default_rng(seed)
    truth = rng.standard_normal((features, 4)).astype(np.float32)
    out = []
    for _ in range(steps):
        x = rng.standard_normal((batch, features)).astype(np.float32)
        y = np.tanh(x @ truth) + 0.1 * rng.standard_normal((batch, 4)).astype(np.float32)
        out.append({"x": x, "y": y})
    return out


def init_params(seed: int, features: int = 16, hidden: int = 64):
    import numpy as np

    rng = np.random.default_rng(seed)
    return {"w1": (rng.standard_normal((features, hidden)) / np.sqrt(features)).astype(np.float32),
            "b1": np.zeros(hidden, np.float32),
            "w2": (rng.standard_normal((hidden, 4)) / np.sqrt(hidden)).astype(np.float32)}


def loss_fn(params, batch):
    import jax.numpy as jnp

    hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2)


def one_process(data, tx, params):
    """The reference: the same steps as one plain jax.jit program on this process's device."""
    import jax
    import optax

    with jax.default_device(jax.local_devices()[0]):
        state = tx.init(params)

        @jax.jit
        def step(params, state, batch):
            loss, grads = jax.value_and_grad(loss_fn)(params, batch)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state, loss

        losses = []
        for batch in data:
            params, state, loss = step(params, state, batch)
            losses.append(float(loss))
    return losses, params


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64, help="global batch (all ranks)")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--check", action="store_true", help="compare with one process")
    parser.add_argument("--algorithm", default="xla", choices=["xla", "tree", "ring", "auto"],
                        help="how the optimizer sums gradient buckets")
    from parallax.metrics import add_arguments

    args = add_arguments(parser).parse_args(argv)
    if "PARALLAX_NUM_PROCESSES" not in os.environ:
        from parallax.cli import simulate_cpu_devices

        print(simulate_cpu_devices(8))

    import parallax.horovod as hvd

    hvd.init()
    import jax
    import numpy as np
    import optax

    import parallax as px

    params = hvd.broadcast_parameters(init_params(seed=hvd.rank()), root_rank=0)
    tx = hvd.DistributedOptimizer(optax.adam(args.lr),     # lr for the global batch
                                  algorithm=args.algorithm)
    opt_state = hvd.broadcast_optimizer_state(tx.init(params), root_rank=0)
    data = teacher_data(args.steps, args.batch)
    rows = px.distributed.process_slice(args.batch)          # this rank's shard

    @hvd.jit
    def step(params, opt_state, batch):                      # per rank: its own rows
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, hvd.allreduce(loss)

    losses = []
    matmul_params = sum(w.size for name, w in params.items() if name.startswith("w"))
    with px.metrics.Monitor(items_per_step=args.batch, unit="ex",  # bar and log: rank 0
                            flops_per_step=6 * matmul_params * args.batch,
                            logdir=args.logdir, profile_steps=args.profile_steps,
                            description=f"{hvd.size()} ranks, {jax.device_count()} devices"
                            ) as monitor:
        for batch in monitor.loop(data):
            mine = {k: v[rows] for k, v in batch.items()}
            params, opt_state, loss = step(params, opt_state, mine)
            losses.append(float(loss))
            monitor.step(loss, loss=losses[-1])
    if hvd.rank() == 0:
        print(monitor.table(), flush=True)
    if not args.check:
        return 0
    ref_losses, ref_params = one_process(data, optax.adam(args.lr), init_params(seed=0))
    loss_gap = px.testing.relative_difference(np.asarray(losses), np.asarray(ref_losses))
    param_gap = px.testing.relative_difference(jax.device_get(params), ref_params)
    print(f"rank {hvd.rank()}: matches the one-process run: losses {loss_gap:.1e}, "
          f"parameters {param_gap:.1e} (relative)", flush=True)
    return 0 if max(loss_gap, param_gap) <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
