"""Data-parallel training steps against PyTorch DDP: 2 CPU processes, gloo, one run.

    python benchmarks/ddp_vs_torch.py [--np 2] [--steps 10] [--rounds 7] [--batch 64]

The script starts itself under ``parallax launch -np N`` (or run it under the launcher).
Every process builds the same MLP (4 dense layers of 1024, GELU), Adam, and a batch of
``--batch`` rows of its own; the programs below then take turns in the same processes,
``--steps`` steps each per round, ``--rounds`` rounds (round-robin: a shared machine's noise
falls on all of them alike, and only ratios measured together mean anything):

- ``torch DDP``: ``torch.nn.parallel.DistributedDataParallel`` over gloo (an optional peer:
  ``pip install torch==2.13.0``; skipped when torch is missing);
- ``hand-written JAX``: ``jax.jit`` with ``NamedSharding`` s, the all-reduce left to XLA;
- ``px.DataParallel``: the default sync, the backend's choice (across CPU processes one
  tree exchange per gradient, ``px.AllReduceSync("tree")``; the chosen sync is printed);
- ``px sync='xla'``: one ``psum`` per gradient, XLA's all-reduce (the default before
  2026-12-07), and ``px sync='xla' no combiner``: the same program compiled with XLA's CPU
  all-reduce combiner off (``compiler_options``), which lets each gradient's all-reduce
  start as the backward produces it (the cause of the gap: ``docs/performance.md, "The gradient sync across processes"``);
- ``px sync='tree'``: the tree exchange named (the default's choice across CPU processes;
  with ``--np 1`` and simulated devices it measures the exchange where the default keeps XLA's);
- ``px BucketedSync``: DDP's buckets as one ``psum`` per bucket (``packing="operands"``,
  the default);
- ``px BucketedSync flat``: buckets as a concatenated flat buffer (the previous default);
- ``px BucketedSync bf16``: operands, bf16 on the wire;
- ``px BucketedSync tree`` and ``px BucketedSync ring``: each gradient reduced by
  ``parallax.comm``'s point-to-point algorithms (``collective-permute`` s) instead of XLA's
  all-reduce;
- ``JAX all-reduce alone`` and ``torch all-reduce alone``: one gradient-sized (16 MB)
  all-reduce over gloo and nothing else, to tell the collective's cost from the step's.

It prints each program's median milliseconds per step and the ratios to torch DDP and to
``px.DataParallel``. What moved the numbers is in ``docs/performance.md, "The gradient sync across processes"`` and
``docs/distributed.md``. ``--only a,b`` keeps the programs whose names contain a or b
(torch DDP and the default always run).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

WIDTH, LAYERS = 1024, 4


def _relaunch(argv, processes: int) -> int:
    command = [sys.executable, "-m", "parallax.cli", "launch", "-np", str(processes),
               sys.executable, os.path.abspath(__file__), *argv]
    os.execvp(command[0], command)
    return 1  # not reached


def torch_program(batch, lr):
    """A DDP step over gloo, or None without torch."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return None
    import jax

    host, port = os.environ["PARALLAX_COORDINATOR"].rsplit(":", 1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(int(port) + 1),
                      GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=jax.process_index(), world_size=jax.process_count())
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // jax.process_count()))
    torch.manual_seed(0)
    layers = []
    for i in range(LAYERS):
        layers.append(torch.nn.Linear(WIDTH, WIDTH))
        if i < LAYERS - 1:
            layers.append(torch.nn.GELU())
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*layers))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    x, y = torch.from_numpy(batch["x"]), torch.from_numpy(batch["y"])

    def step():
        opt.zero_grad(set_to_none=True)
        loss = torch.mean((model(x) - y) ** 2)
        loss.backward()
        opt.step()
        return loss

    grads = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def all_reduce():  # the collective alone: one gradient-sized all-reduce over gloo
        dist.all_reduce(grads)
        return grads[0].item()

    return (lambda: step().item()), all_reduce


def jax_programs(batch, lr):
    """name -> a function running one step (blocking), for the JAX programs."""
    import jax
    import numpy as np
    import optax
    from flax import nnx

    import parallax as px

    mesh = px.make_mesh(data=-1)

    def make_state():
        return px.TrainState.create(px.models.MLP(WIDTH, [WIDTH] * (LAYERS - 1), WIDTH,
                                                  rngs=nnx.Rngs(0)), optax.adam(lr))

    def stepper(strategy, compiler_options=None):
        state = [px.init(make_state, mesh, strategy)]
        data = px.distributed.global_batch(batch, mesh, strategy)

        @px.train_step(mesh, strategy)
        def step(state, batch):
            loss, grads = px.value_and_grad(px.models.mse_loss)(state.model, batch)
            return state.apply_gradients(grads), {"loss": loss}

        if compiler_options:  # this program only: the calls then run it
            step.compile(state[0], data, compiler_options=compiler_options)

        def run():
            state[0], metrics = step(state[0], data)
            return float(metrics["loss"])

        return run

    def hand_written():
        strategy = px.DataParallel("data", style="gspmd")
        state = [px.init(make_state, mesh, strategy)]
        data = px.distributed.global_batch(batch, mesh, strategy)
        shardings = jax.tree.map(lambda x: x.sharding, state[0])

        @jax.jit
        def step(state, batch):
            def loss(params):
                model = nnx.merge(state.graphdef, params, state.rest)
                return px.models.mse_loss(model, batch)

            value, grads = jax.value_and_grad(loss)(state.params)
            return jax.lax.with_sharding_constraint(state.apply_gradients(grads), shardings), value

        def run():
            state[0], loss = step(state[0], data)
            return float(loss)

        return run

    def all_reduce():  # the collective alone: one gradient-sized psum, as XLA runs it
        size = LAYERS * (WIDTH * WIDTH + WIDTH)
        summed = jax.jit(jax.shard_map(lambda g: jax.lax.psum(g, "data"), mesh=mesh,
                                       in_specs=jax.P("data"), out_specs=jax.P("data")))
        grads = [px.distributed.global_batch(np.ones((size,), np.float32), mesh,
                                             px.DataParallel("data"))]

        def run():
            grads[0] = summed(grads[0])
            return float(grads[0][0])

        return run

    no_combiner = {"xla_disable_hlo_passes": "cpu-all-reduce-combiner"}
    return {
        "hand-written JAX": hand_written,
        "px.DataParallel": lambda: stepper(px.DataParallel("data")),
        "px sync='xla'": lambda: stepper(px.DataParallel("data", sync="xla")),
        "px sync='xla' no combiner": lambda: stepper(px.DataParallel("data", sync="xla"),
                                                     no_combiner),
        "px sync='tree'": lambda: stepper(px.DataParallel("data", sync="tree")),
        "px BucketedSync": lambda: stepper(px.DataParallel("data", sync=px.BucketedSync())),
        "px BucketedSync flat": lambda: stepper(px.DataParallel(
            "data", sync=px.BucketedSync(packing="flat"))),
        "px BucketedSync bf16": lambda: stepper(px.DataParallel(
            "data", sync=px.BucketedSync(compression="bf16"))),
        "px BucketedSync tree": lambda: stepper(px.DataParallel(
            "data", sync=px.BucketedSync(algorithm="tree"))),
        "px BucketedSync ring": lambda: stepper(px.DataParallel(
            "data", sync=px.BucketedSync(algorithm="ring"))),
        "JAX all-reduce alone": all_reduce,
    }


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2, help="processes")
    parser.add_argument("--steps", type=int, default=10, help="steps per program per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch", type=int, default=64, help="rows per process")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--only", default="", help="comma-separated parts of program names")
    args = parser.parse_args(argv)
    if "PARALLAX_NUM_PROCESSES" not in os.environ:
        return _relaunch(argv, args.np)

    import parallax as px

    px.distributed.initialize()
    import jax
    import numpy as np

    rng = np.random.default_rng(px.distributed.rank())
    batch = {"x": rng.standard_normal((args.batch, WIDTH), np.float32),
             "y": rng.standard_normal((args.batch, WIDTH), np.float32)}
    wanted = [w for w in args.only.split(",") if w]
    keep = lambda name: (not wanted or name in ("torch DDP", "px.DataParallel")  # noqa: E731
                         or any(w in name for w in wanted))
    programs = {}
    torch_steps = torch_program(batch, args.lr)
    if torch_steps is not None:
        programs["torch DDP"] = torch_steps[0]
    programs.update({name: build() for name, build in jax_programs(batch, args.lr).items()
                     if keep(name)})
    if torch_steps is not None and keep("torch all-reduce alone"):
        programs["torch all-reduce alone"] = torch_steps[1]
    load_before = os.getloadavg()[0]
    for run in programs.values():  # compile and warm up
        run()
        run()
    times = {name: [] for name in programs}
    for _ in range(args.rounds):
        for name, run in programs.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                run()
            times[name].append((time.perf_counter() - start) / args.steps)
    if jax.process_index() == 0:
        medians = {name: statistics.median(t) for name, t in times.items()}
        base = medians["px.DataParallel"]
        torch_ms = medians.get("torch DDP")
        from parallax.grad.default_sync import default_sync

        print(f"\nMLP {LAYERS} x {WIDTH}, Adam, batch {args.batch} per process, "
              f"{jax.process_count()} processes x {jax.local_device_count()} CPU device(s), "
              f"gloo; {args.rounds} rounds of {args.steps} steps, alternating; jax "
              f"{jax.__version__}; px.DataParallel's sync here: "
              f"{default_sync(px.make_mesh(data=-1), ('data',))!r}")
        print(f"{'program':<24}{'median ms':>11}{'/ torch':>9}{'/ px.DP':>9}")
        for name, med in medians.items():
            vs_torch = f"{med / torch_ms:>9.2f}" if torch_ms else f"{'-':>9}"
            print(f"{name:<24}{med * 1e3:>11.1f}{vs_torch}{med / base:>9.2f}")
        if torch_ms is None:
            print("(torch is not installed: pip install torch==2.13.0 to add the peer)")
        print(f"machine load (1-minute average, {os.cpu_count()} cores): {load_before:.1f} "
              f"before, {os.getloadavg()[0]:.1f} after")
    px.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
