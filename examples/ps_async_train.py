"""Asynchronous parameter-server training: TensorFlow's ParameterServerStrategy, on Ray.

    python examples/ps_async_train.py --steps 60 --workers 2 --ps 2
    python examples/ps_async_train.py --check          # one worker: equal to one device

A student MLP learns a fixed teacher MLP. Its parameters and Adam's moments live on
``--ps`` parameter-server actors (each matrix split in ``--ps`` shards along axis 0); a
``ClusterCoordinator`` schedules ``--steps`` training functions on ``--workers`` worker
actors, each of which pulls the parameters, computes gradients with ``jax.jit`` on its own
input pipeline, and pushes them: asynchronous SGD, as the book's chapter 19 runs it. With
``--check`` there is one worker and each step waits for the previous one, and the run is
compared with plain ``jax.jit`` training on one device (they agree to float32 rounding).

Everything runs on a local Ray cluster bound to 127.0.0.1 (``--address`` joins another).
"""

from __future__ import annotations

import argparse
import collections
import os
import time

from parallax.cli import simulate_cpu_devices


def teacher_batches(pipeline: int, batch: int, count: int):
    """``count`` batches of ``(x, teacher(x))`` for one input pipeline (its own seed)."""
    import numpy as np

    teacher = np.random.default_rng(1234)
    w1 = teacher.standard_normal((16, 32)).astype(np.float32) / 4
    w2 = teacher.standard_normal((32, 4)).astype(np.float32) / 6
    rng = np.random.default_rng(pipeline)
    for _ in range(count):
        x = rng.standard_normal((batch, 16)).astype(np.float32)
        yield {"x": x, "y": np.tanh(x @ w1) @ w2}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="scheduled training steps")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ps", type=int, default=2, help="parameter servers")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--address", default=None, help="a running Ray cluster to join")
    parser.add_argument("--check", action="store_true",
                        help="one worker, steps in order, compared with one device")
    args = parser.parse_args(argv)
    print(simulate_cpu_devices(8))

    import jax
    import numpy as np
    import optax
    from flax import nnx

    import parallax as px
    import parallax.ps  # noqa: F401  (Ray loads on first use)
    import parallax.tf  # noqa: F401

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    px.ps.init_cluster(args.address, **({} if args.address else {"log_to_driver": False}))
    workers = 1 if args.check else args.workers
    tx = optax.adam(1e-2)
    make_model = lambda: px.models.MLP(16, [64], 4, rngs=nnx.Rngs(0))

    strategy = px.tf.ParameterServerStrategy(
        px.tf.RayClusterResolver(num_workers=workers, num_ps=args.ps, address=args.address),
        variable_partitioner=px.tf.FixedShardsPartitioner(args.ps))
    model = strategy.distribute_model(make_model(), tx)
    coordinator = px.tf.ClusterCoordinator(strategy)
    train = model.train_step(px.models.mse_loss)
    steps, batch = args.steps, args.batch
    dataset = iter(coordinator.create_per_worker_dataset(
        lambda context: teacher_batches(context.input_pipeline_id, batch, steps)))

    def worker_fn(iterator):
        return os.getpid(), train(next(iterator))

    start = time.perf_counter()
    if args.check:  # in order: each step sees the previous one's update
        results = [coordinator.schedule(worker_fn, args=(dataset,)).fetch() for _ in range(steps)]
    else:
        values = [coordinator.schedule(worker_fn, args=(dataset,)) for _ in range(steps)]
        coordinator.join()
        results = coordinator.fetch(values)
    seconds = time.perf_counter() - start
    losses = [loss for _, loss in results]
    per_worker = collections.Counter(pid for pid, _ in results)
    print(f"{steps} steps on {workers} worker(s) and {args.ps} parameter server(s) in "
          f"{seconds:.1f} s; functions per worker process: {dict(per_worker)}")
    print(f"loss: first 5 steps {np.mean(losses[:5]):.4f}, last 5 steps {np.mean(losses[-5:]):.4f}")
    shards = {name: [(s.rows, s.server) for s in v.shards] for name, v in model.variables.items()}
    print(f"shards (rows, server): {shards}")
    report = {"losses": losses, "workers": dict(per_worker)}

    if args.check:
        reference = px.testing.train(
            lambda: px.TrainState.create(make_model(), tx), px.models.mse_loss,
            list(teacher_batches(0, batch, steps)))
        gap = px.testing.relative_difference(np.array(losses), np.array(reference.losses))
        params = px.testing.relative_difference(coordinator.fetch(model),
                                                jax.device_get(reference.final_params))
        print(f"one worker vs one device: losses {gap:.1e}, parameters {params:.1e} (relative)")
        report.update(loss_gap=gap, param_gap=params)
    coordinator.shutdown()
    strategy.shutdown()
    return report


if __name__ == "__main__":
    main()
