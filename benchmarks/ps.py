"""Parameter servers on Ray: throughput, staleness and push/pull bandwidth.

Three tables:

1. **Steps per second** of asynchronous parameter-server training (``px.tf``'s
   ``ParameterServerStrategy`` + ``ClusterCoordinator``) with 1, 2 and 4 workers, next to
   synchronous ``px.DataParallel`` on the same model, batch and optimizer (one ``jit``ted
   step over a ``data`` mesh of the same number of devices). On one machine the workers share
   its cores: the numbers show the overhead of the parameter-server round trips, not a
   speed-up.
2. **Staleness** (``t - min(clock)`` of every pull, recorded by the servers) of
   asynchronous SGD on least squares with 4 workers of different speeds, under sequential,
   ``BoundedDelay(2)`` and eventual consistency.
3. **Bandwidth** of ``KVWorker.push`` and ``pull`` (keys sliced over the servers, one actor
   call each, values through Ray's object store) against raw Ray moving the same bytes: an
   actor call taking the array (push) or returning it (pull), and ``ray.put``/``ray.get``
   in this process, timed alternately (best of the repeats: on a shared machine the
   slowest ones measure the neighbours). A push must at least read what arrives (the server
   adds it to its values: one read-modify-write pass), so its baseline is the raw call
   whose receiver reads the array once; the raw call that never touches the bytes is shown
   too. Target: >= 0.8 of raw.

Usage:
  python benchmarks/ps.py [--sizes-mb 1 16 64] [--repeats 5] [--steps 40] [--skip ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def timed(fn, repeats):
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def bandwidth(sizes_mb, repeats, servers):
    import numpy as np
    import ray

    import parallax as px

    @ray.remote(num_cpus=0)
    class Raw:
        def take(self, array):
            return array.nbytes

        def read(self, array):
            return float(array.sum())

        def keep(self, array):
            self.array = np.array(array)

        def give(self):
            return self.array

    raw = Raw.remote()
    store = px.ps.KVStore(num_servers=servers, consistency="eventual")
    worker = store.client()
    print(f"\npush / pull bandwidth, {servers} server(s), best of {repeats} "
          f"(alternating with raw Ray)")
    print(f"{'MB':>6}{'push GB/s':>11}{'raw+read':>10}{'ratio':>7}{'raw':>7}{'ratio':>7}"
          f"{'pull GB/s':>11}{'raw':>7}{'ratio':>7}{'put+get GB/s':>14}")
    ratios = []
    for mb in sizes_mb:
        size = mb * (1 << 20) // 4
        values = np.random.default_rng(0).standard_normal(size).astype(np.float32)
        keys_per_server = 64
        ranges = store.server_key_ranges()
        keys = np.concatenate([np.arange(keys_per_server, dtype=np.uint64) + np.uint64(r.begin)
                               for r in ranges])
        values = values[: size - size % keys.size]
        nbytes = values.nbytes
        store.reset()  # keys take new lengths
        worker.wait(worker.push(keys, values))
        ray.get(raw.keep.remote(values))
        samples = {"push": [], "raw_read": [], "raw_push": [], "pull": [], "raw_pull": [],
                   "put_get": []}
        for _ in range(repeats):  # alternate: the machine is shared
            samples["push"].append(timed(lambda: worker.wait(worker.push(keys, values)), 1))
            samples["raw_read"].append(timed(lambda: ray.get(raw.read.remote(values)), 1))
            samples["raw_push"].append(timed(lambda: ray.get(raw.take.remote(values)), 1))
            samples["pull"].append(timed(lambda: worker.wait(worker.pull(keys)), 1))
            samples["raw_pull"].append(timed(lambda: ray.get(raw.give.remote()), 1))
            samples["put_get"].append(timed(lambda: ray.get(ray.put(values)), 1))
        # the fastest of the alternating repeats: the one least disturbed by other processes
        gbps = {k: nbytes / min(v) / 1e9 for k, v in samples.items()}
        push_ratio, pull_ratio = gbps["push"] / gbps["raw_read"], gbps["pull"] / gbps["raw_pull"]
        ratios += [push_ratio, pull_ratio]
        print(f"{mb:>6}{gbps['push']:>11.2f}{gbps['raw_read']:>10.2f}{push_ratio:>7.2f}"
              f"{gbps['raw_push']:>7.2f}{gbps['push'] / gbps['raw_push']:>7.2f}"
              f"{gbps['pull']:>11.2f}{gbps['raw_pull']:>7.2f}{pull_ratio:>7.2f}"
              f"{gbps['put_get']:>14.2f}")
    print(f"target: push >= 0.8 of raw+read, pull >= 0.8 of raw; worst {min(ratios):.2f}")
    store.shutdown()
    ray.kill(raw)


def staleness(steps):
    import numpy as np
    import optax

    import parallax as px

    def worker_program(worker, x, y, steps, delays):
        import time

        import numpy as np

        rng = np.random.default_rng(worker.rank)
        keys = np.arange(x.shape[1], dtype=np.uint64)
        for _ in range(steps):
            w = worker.wait(worker.pull(keys))
            rows = rng.integers(0, x.shape[0], 32)
            grad = x[rows].T @ (x[rows] @ w - y[rows]) / 32
            time.sleep(delays[worker.rank])
            worker.push(keys, grad.astype(np.float32))

    rng = np.random.default_rng(0)
    x = rng.standard_normal((1024, 16)).astype(np.float32)
    w_star = rng.standard_normal(16).astype(np.float32)
    y = x @ w_star
    delays = (0.0, 0.002, 0.005, 0.01)
    print(f"\nstaleness of asynchronous SGD, 4 workers (sleeps {delays} s per step), "
          f"{steps} steps each")
    print(f"{'consistency':<22}{'mean':>7}{'p90':>6}{'max':>6}{'seconds':>9}{'|w - w*|/|w*|':>16}")
    with px.ps.KVStore(num_servers=2, num_workers=4) as store:
        keys = np.arange(16, dtype=np.uint64)
        store.reset(handle=optax.sgd(0.05), consistency="sequential")
        client = store.client()
        client.wait(client.push(keys, np.zeros(16, np.float32), cmd=px.ps.ASSIGN))
        # one sequential step: returns once all 4 worker processes run (started, untimed)
        px.ps.run_workers(store, worker_program, x, y, 1, delays)
        for model in ("sequential", px.ps.BoundedDelay(2), px.ps.BoundedDelay(8), "eventual"):
            store.reset(handle=optax.sgd(0.05), consistency=model)
            client = store.client()
            client.wait(client.push(keys, np.zeros(16, np.float32), cmd=px.ps.ASSIGN))
            start = time.perf_counter()
            px.ps.run_workers(store, worker_program, x, y, steps, delays)
            seconds = time.perf_counter() - start
            measured = store.staleness()
            w = client.wait(client.pull(keys))
            error = np.linalg.norm(w - w_star) / np.linalg.norm(w_star)
            print(f"{str(model):<22}{measured.mean():>7.2f}{np.percentile(measured, 90):>6.0f}"
                  f"{measured.max():>6}{seconds:>9.2f}{error:>16.2e}")


def throughput(steps, worker_counts):
    import jax
    import numpy as np
    import optax
    from flax import nnx

    import parallax as px

    def make_model():
        return px.models.MLP(64, [256, 256], 64, rngs=nnx.Rngs(0))

    batch = 64
    rng = np.random.default_rng(0)
    data = [{"x": rng.standard_normal((batch, 64)).astype(np.float32),
             "y": rng.standard_normal((batch, 64)).astype(np.float32)} for _ in range(8)]
    print(f"\nsteps per second, MLP 64-256-256-64, batch {batch}, Adam, {steps} steps")
    print(f"{'program':<40}{'steps/s':>9}{'ratio':>7}")
    base = None
    for workers in worker_counts:
        devices = jax.devices()[:workers]
        mesh = px.make_mesh(data=len(devices), devices=devices)
        strategy = px.DataParallel("data")
        state = px.init(lambda: px.TrainState.create(make_model(), optax.adam(1e-3)), mesh,
                        strategy)

        @px.train_step(mesh, strategy)
        def step(state, batch):
            loss, grads = px.value_and_grad(px.models.mse_loss)(state.model, batch)
            return state.apply_gradients(grads), {"loss": loss}

        state, _ = step(state, data[0])
        start = time.perf_counter()
        for i in range(steps):
            state, metrics = step(state, data[i % len(data)])
        jax.block_until_ready(metrics)
        dp = steps / (time.perf_counter() - start)

        ps_strategy = px.tf.ParameterServerStrategy(px.tf.RayClusterResolver(workers, num_ps=2),
                                                    px.tf.FixedShardsPartitioner(2))
        model = ps_strategy.distribute_model(make_model(), optax.adam(1e-3))
        coordinator = px.tf.ClusterCoordinator(ps_strategy)
        train = model.train_step(px.models.mse_loss)
        dataset = iter(coordinator.create_per_worker_dataset(lambda: iter(data * 10_000)))
        worker_fn = lambda iterator: train(next(iterator))
        for _ in range(2 * workers):  # warm up: every worker compiles its step
            coordinator.schedule(worker_fn, args=(dataset,))
        coordinator.join()
        start = time.perf_counter()
        for _ in range(steps):
            coordinator.schedule(worker_fn, args=(dataset,))
        coordinator.join()
        ps = steps / (time.perf_counter() - start)
        coordinator.shutdown()
        ps_strategy.shutdown()
        base = base or dp
        print(f"{f'px.DataParallel, {workers} device(s), sync':<40}{dp:>9.1f}{dp / base:>7.2f}")
        print(f"{f'parameter servers, {workers} worker(s), async':<40}{ps:>9.1f}{ps / base:>7.2f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--servers", type=int, default=1, help="servers in the bandwidth test")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--skip", nargs="*", default=[],
                        choices=["throughput", "staleness", "bandwidth"])
    args = parser.parse_args(argv)

    from parallax.cli import simulate_cpu_devices

    print(simulate_cpu_devices(8))
    import parallax as px
    import parallax.ps  # noqa: F401  (px.ps; Ray loads on first use)

    px.ps.init_cluster(num_cpus=4, object_store_memory=max(args.sizes_mb) * 6 << 20,
                       log_to_driver=False)
    try:
        if "bandwidth" not in args.skip:
            bandwidth(args.sizes_mb, args.repeats, args.servers)
        if "staleness" not in args.skip:
            staleness(args.steps)
        if "throughput" not in args.skip:
            throughput(args.steps, args.workers)
    finally:
        px.ps.shutdown_cluster()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
