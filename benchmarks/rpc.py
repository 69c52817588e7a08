"""parallax.rpc side by side with torch.distributed.rpc (TensorPipe), and the RPC pipeline's
step time.

Three tables, each timed alternately in one run (the machine is shared: medians over rounds,
the ratio of each round, the load average printed with them):

1. **init_rpc, 3 workers.** parallax: ``init_rpc("worker0", rank=0, world_size=3)`` on a
   running Ray cluster (the first group's time, which starts the worker processes, is shown
   apart: later groups reuse them), then ``shutdown()``. torch: three peer processes
   (``benchmarks/torch_rpc_peer.py``, torch already imported, fresh for every round) call
   ``init_rpc`` together; the time is rank 0's call (TensorPipe's rendezvous and agent
   start), then a graceful ``shutdown()``.
2. **rpc_sync, payloads 1 KB .. 16 MB**, both groups up at once: the driver sends a float32
   array (a ``torch.Tensor`` made with ``torch.from_numpy`` for torch) to worker1, which
   answers with its byte count; each round times a batch of calls of one, then of the other
   (the order alternates), per call. Targets: parallax <= 2x torch at 1 KB, <= 1.5x at 1 MB;
   init_rpc <= 2 s.
3. **The pipeline example's training step** (``examples/rpc/pipeline.py``: two shards on two
   workers, forward through RRef proxies, distributed-autograd backward, DistributedOptimizer)
   against the same model and Adam step in one process (one ``jax.jit``ted step): the cost of
   its messages, not of the math (the model is tiny).

torch is a test-only peer: without it the torch columns are skipped.

Usage:
  python benchmarks/rpc.py [--sizes-kb 1 64 1024 16384] [--rounds 9] [--init-rounds 5]
                           [--steps 20]
  (``--steps 0`` skips the pipeline table, ``--init-rounds 0`` the init_rpc one)
"""

from __future__ import annotations

import argparse
import importlib.util
import operator
import os
import pathlib
import runpy
import socket
import statistics
import subprocess
import sys
import time
import warnings

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
warnings.filterwarnings("ignore", message="You are using a Backend")  # torch's own, harmless
os.environ.setdefault("TP_SOCKET_IFNAME", "lo")  # TensorPipe on loopback, as parallax
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

HERE = pathlib.Path(__file__).parent
nbytes = operator.attrgetter("nbytes")  # pickled by reference, works on arrays and tensors


def timed_pair(*fns, repeats):
    """Times ``fns`` alternately; per function (median, best) in seconds."""
    samples = tuple([] for _ in fns)
    for _ in range(repeats):
        for fn, out in zip(fns, samples):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return [(statistics.median(s), min(s)) for s in samples]


def load() -> str:
    return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg())


def spread(values) -> str:
    """``median (min-max)``."""
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


class TorchGroup:
    """torch.distributed.rpc with 3 workers: ranks ``first..2`` in peer processes, rank 0
    here unless ``first == 0``."""

    def __init__(self, world_size: int = 3, first: int = 1):
        with socket.socket() as probe:  # a free port on loopback for TensorPipe's rendezvous
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.world_size, self.here = world_size, first == 1
        self.peers = [subprocess.Popen(
            [sys.executable, str(HERE / "torch_rpc_peer.py"), str(rank), str(world_size),
             str(self.port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            for rank in range(first, world_size)]
        for peer in self.peers:
            assert peer.stdout.readline().strip() == "ready"

    def init(self) -> float:
        """Starts the group; seconds rank 0's ``init_rpc`` took."""
        import torch.distributed.rpc as rpc

        start = time.perf_counter()
        for peer in self.peers:
            peer.stdin.write("go\n")
            peer.stdin.flush()
        if not self.here:  # rank 0 is a peer: its own measure
            return float(self.peers[0].stdout.readline().split()[1])
        options = rpc.TensorPipeRpcBackendOptions(
            init_method=f"tcp://127.0.0.1:{self.port}", num_worker_threads=16)
        rpc.init_rpc("worker0", rank=0, world_size=self.world_size,
                     rpc_backend_options=options)
        return time.perf_counter() - start

    def close(self) -> None:
        if self.here:
            import torch.distributed.rpc as rpc

            rpc.shutdown()
        for peer in self.peers:
            peer.wait(60)


def init_times(rounds: int, with_torch: bool):
    import parallax.rpc as rpc
    from parallax.ray_cluster.connect import init_cluster

    start = time.perf_counter()
    init_cluster()
    cluster = time.perf_counter() - start
    start = time.perf_counter()
    rpc.init_rpc("worker0", rank=0, world_size=3)
    first = time.perf_counter() - start
    rpc.shutdown()
    ours, theirs = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        rpc.init_rpc("worker0", rank=0, world_size=3)
        ours.append(time.perf_counter() - start)
        rpc.shutdown()
        if with_torch:
            group = TorchGroup(first=0)  # fresh processes: see torch_rpc_peer.py
            theirs.append(group.init())
            group.close()
    print(f"\ninit_rpc, 3 workers, {rounds} alternating rounds ({load()}), seconds")
    print(f"  Ray cluster start (once per process): {cluster:.2f}; first parallax group "
          f"(starts the worker processes): {first:.2f}")
    print(f"  parallax init_rpc: median {statistics.median(ours):.3f} (min {min(ours):.3f}, "
          f"max {max(ours):.3f})")
    if theirs:
        print(f"  torch init_rpc:    median {statistics.median(theirs):.3f} (min "
              f"{min(theirs):.3f}, max {max(theirs):.3f})")
        print(f"  parallax / torch: {spread([a / b for a, b in zip(ours, theirs)])}")
    return cluster, first, ours, theirs


def calls(sizes_kb, rounds: int, with_torch: bool):
    import numpy as np

    import parallax.rpc as prpc

    if with_torch:
        import torch
        import torch.distributed.rpc as trpc
    print(f"\nrpc_sync (array sent, its size returned), {rounds} alternating rounds "
          f"({load()}); per call: median (min-max) over the rounds, ms")
    print(f"{'payload':>9}{'calls/round':>12}{'parallax ms':>22}{'torch ms':>22}"
          f"{'parallax / torch':>22}")
    rows = []
    for kb in sizes_kb:
        array = np.random.default_rng(0).standard_normal(kb * 256).astype(np.float32)
        tensor = torch.from_numpy(array) if with_torch else None
        count = min(100, max(4, (16 << 20) // array.nbytes))

        def ours():
            for _ in range(count):
                prpc.rpc_sync("worker1", nbytes, args=(array,))

        def theirs():
            for _ in range(count):
                trpc.rpc_sync("worker1", nbytes, args=(tensor,))

        ours(), with_torch and theirs()  # warm up
        mine, torch_ms = [], []
        for r in range(rounds):
            pair = [(ours, mine), (theirs, torch_ms)][:1 + with_torch]
            for fn, out in (pair if r % 2 == 0 else pair[::-1]):
                start = time.perf_counter()
                fn()
                out.append((time.perf_counter() - start) / count * 1e3)
        label = f"{kb} KB" if kb < 1024 else f"{kb // 1024} MB"
        ratio = spread([a / b for a, b in zip(mine, torch_ms)]) if torch_ms else "-"
        print(f"{label:>9}{count:>12}{spread(mine):>22}"
              f"{spread(torch_ms) if torch_ms else '-':>22}{ratio:>22}")
        rows.append((kb, mine, torch_ms))
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
    parser.add_argument("--sizes-kb", type=int, nargs="+", default=[1, 64, 1024, 16384])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--init-rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    import jax
    import ray

    import parallax.rpc as rpc

    with_torch = importlib.util.find_spec("torch") is not None
    versions = f"jax {jax.__version__}, ray {ray.__version__}"
    if with_torch:
        import torch

        versions += f", torch {torch.__version__} (TensorPipe)"
    print(f"{versions}, Python {sys.version.split()[0]}, {os.cpu_count()} CPUs, {load()}")
    if args.init_rounds:
        init_times(args.init_rounds, with_torch)
    rpc.init_rpc("worker0", rank=0, world_size=3)
    group = TorchGroup() if with_torch else None
    try:
        if group is not None:
            group.init()
        calls(args.sizes_kb, args.rounds, with_torch)
        if args.steps:
            pipeline(args.steps)
    finally:
        if group is not None:
            group.close()
        rpc.shutdown()


if __name__ == "__main__":
    main()
