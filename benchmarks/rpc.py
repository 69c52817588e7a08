"""parallax.rpc: call latency and bandwidth against raw Ray, and the RPC pipeline's step time.

Two tables:

1. **rpc_sync vs a raw Ray actor call**, payloads 1 KB .. 64 MB: the driver sends a float32
   array to worker1, which answers with its byte count (``rpc.rpc_sync("worker1", nbytes,
   args=(array,))``), against a plain Ray actor method doing the same (``actor.take.remote(
   array)``, ``ray.get``). The two are timed alternately in one run (median of the repeats,
   and the best of them: on a shared machine the slowest samples measure the neighbours).
   The small payloads give the round-trip latency (each sample times a batch of up to 50
   calls, a sample of one call being mostly noise), the large ones the bandwidth (bytes sent
   / time). Target: rpc_sync >= 0.8 of raw. A third column, timed in the same alternation,
   is a raw Ray call carrying rpc_sync's message (``(method, (fn, args, kwargs, ...))`` as
   one argument, to a threaded actor like ``RpcWorker``): the part of rpc_sync's time that
   is Ray's, for the message parallax must send.
2. **The pipeline example's training step** (``examples/rpc/pipeline.py``: two shards on two
   workers, forward through RRef proxies, distributed-autograd backward, DistributedOptimizer)
   against the same model and Adam step in one process (one ``jax.jit``ted step). The model
   is tiny: the RPC step time is the cost of its messages (2 forward calls, the loss call,
   2 backward calls, 2 optimizer steps), not of the math.

Usage:
  python benchmarks/rpc.py [--sizes-kb 1 64 1024 16384 65536] [--repeats 5] [--steps 20]
  (``--steps 0`` skips the pipeline table)
"""

from __future__ import annotations

import argparse
import operator
import os
import pathlib
import runpy
import statistics
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

nbytes = operator.attrgetter("nbytes")  # pickled by reference: no function bytes per call


def timed_pair(*fns, repeats):
    """Times ``fns`` alternately; per function (median, best) in seconds."""
    samples = tuple([] for _ in fns)
    for _ in range(repeats):
        for fn, out in zip(fns, samples):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return [(statistics.median(s), min(s)) for s in samples]


def calls(sizes_kb, repeats):
    import numpy as np
    import ray

    import parallax.rpc as rpc

    @ray.remote(num_cpus=0)
    class Raw:
        def take(self, array):
            return array.nbytes

    @ray.remote(num_cpus=0, max_concurrency=32)
    class RawWithMessage:  # RpcWorker's shape: threaded, one (method, args) argument
        def dispatch(self, call):
            method, (fn, args, kwargs, *_) = call
            return fn(*args, **kwargs)

    raw, message = Raw.remote(), RawWithMessage.remote()
    ray.get(raw.take.remote(np.zeros(1)))
    ray.get(message.dispatch.remote(("run", (nbytes, (np.zeros(1),), {}, None, None, None))))
    rpc.rpc_sync("worker1", nbytes, args=(np.zeros(1),))  # warm the paths
    print(f"\nrpc_sync vs raw Ray actor call (array sent, its size returned), "
          f"{repeats} alternating repeats, median (best), ms per call")
    print(f"{'payload':>9}{'rpc_sync ms':>18}{'raw ms':>18}{'raw+message ms':>18}"
          f"{'rpc GB/s':>10}{'raw GB/s':>10}{'ratio':>7}")
    rows = []
    for kb in sizes_kb:
        array = np.random.default_rng(0).standard_normal(kb * 256).astype(np.float32)
        per_sample = min(50, max(1, (1 << 20) // array.nbytes))  # small: time a batch of calls

        def rpc_calls():
            for _ in range(per_sample):
                rpc.rpc_sync("worker1", nbytes, args=(array,))

        def raw_calls():
            for _ in range(per_sample):
                ray.get(raw.take.remote(array))

        def raw_message_calls():
            for _ in range(per_sample):
                ray.get(message.dispatch.remote(("run", (nbytes, (array,), {}, None, None,
                                                         None))))

        (rpc_med, rpc_best), (raw_med, raw_best), (msg_med, msg_best) = [
            (med / per_sample, best / per_sample)
            for med, best in timed_pair(rpc_calls, raw_calls, raw_message_calls,
                                        repeats=repeats)]
        ratio = raw_med / rpc_med
        label = f"{kb} KB" if kb < 1024 else f"{kb // 1024} MB"
        print(f"{label:>9}{rpc_med * 1e3:>11.3f} ({rpc_best * 1e3:.3f}){raw_med * 1e3:>11.3f} "
              f"({raw_best * 1e3:.3f}){msg_med * 1e3:>11.3f} ({msg_best * 1e3:.3f})"
              f"{array.nbytes / rpc_med / 1e9:>10.3f}{array.nbytes / raw_med / 1e9:>10.3f}"
              f"{ratio:>7.2f}")
        rows.append((kb, rpc_med, raw_med, msg_med, ratio))
    ray.kill(raw)
    ray.kill(message)
    return rows


def pipeline(steps):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import parallax.rpc as rpc
    from parallax.rpc import dist_autograd

    example = runpy.run_path(str(pathlib.Path(__file__).parents[1] / "examples" / "rpc" /
                                 "pipeline.py"), run_name="rpc_pipeline")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 8)).astype(np.float32)
    target = rng.normal(size=(16, 4)).astype(np.float32)
    w = [(rng.normal(size=s) / 3).astype(np.float32) for s in [(8, 16), (16, 4)]]
    tx = optax.adam(0.05)
    shards = [rpc.remote(f"worker{i + 1}", example["Shard"], args=(w[i],)) for i in range(2)]
    params = [r for s in shards for r in s.rpc_sync().parameter_rrefs()]
    optimizer = rpc.DistributedOptimizer(tx, params)

    def rpc_step():
        with dist_autograd.context() as ctx:
            h = shards[0].rpc_sync().forward(x)
            y = shards[1].rpc_sync().forward(h)
            loss = rpc.rpc_sync("worker0", example["mse"], args=(y, target))
            dist_autograd.backward(ctx, [loss])
            optimizer.step(ctx)

    @jax.jit
    def plain_step(p, state):
        grads = jax.grad(example["one_process_loss"])(p, x, target)
        updates, state = tx.update(grads, state, p)
        return optax.apply_updates(p, updates), state

    plain = [jnp.asarray(v) for v in w]
    carry = [plain, tx.init(plain)]

    def one_process_step():
        carry[:] = plain_step(*carry)
        jax.block_until_ready(carry)

    rpc_step(), one_process_step()  # compile / warm up
    (rpc_med, rpc_best), (plain_med, plain_best) = timed_pair(rpc_step, one_process_step,
                                                              repeats=steps)
    print(f"\npipeline example step (2 shards on 2 workers), {steps} alternating steps, "
          f"median (best)")
    print(f"{'':>28}{'ms/step':>18}")
    print(f"{'parallax.rpc (3 workers)':>28}{rpc_med * 1e3:>11.3f} ({rpc_best * 1e3:.3f})")
    print(f"{'one process, jitted':>28}{plain_med * 1e3:>11.3f} ({plain_best * 1e3:.3f})")
    return rpc_med, plain_med


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-kb", type=int, nargs="+", default=[1, 64, 1024, 16384, 65536])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    import jax
    import ray

    import parallax.rpc as rpc

    rpc.init_rpc("worker0", rank=0, world_size=3)
    print(f"jax {jax.__version__}, ray {ray.__version__}, backend {jax.default_backend()}")
    try:
        calls(args.sizes_kb, args.repeats)
        if args.steps:
            pipeline(args.steps)
    finally:
        rpc.shutdown()


if __name__ == "__main__":
    main()
