"""Data parallel and FSDP across processes, each process loading only its own rows.

    parallax launch -np 2 --devices-per-process 2 python examples/multiprocess_dp_fsdp.py
    parallax launch -np 2 python examples/multiprocess_dp_fsdp.py --strategy fsdp --steps 20
    parallax launch -np 2 python examples/multiprocess_dp_fsdp.py --strategy dp-tree
    python examples/multiprocess_dp_fsdp.py                 # alone: 8 simulated devices

Every process runs this same program. ``px.distributed.initialize()`` joins the job that
``parallax launch`` started (or torchrun, SLURM, a TF cluster); the mesh spans every device
of every process. The data set (synthetic, made on the fly) is sharded by process, as
grain's ``ShardByJaxProcess`` does: process ``p`` reads the ``p``-th contiguous part, in
batches of ``global batch / processes`` rows. The loader is grain's (when installed: ``pip
install grain``) or a plain Python iterator over ``px.distributed.process_slice`` of the data
set; both give each process the same rows. Each process passes its share to the step, which
assembles the global batch from the processes' shares (as ``px.distributed.global_batch``
does explicitly), and at the end every process compares its loss curve
with the same steps run as one plain ``jax.jit`` program on the full batches. Process 0 shows
examples/s per device, MFU and memory in a progress bar and a table at the end, and writes
``--logdir``; ``--profile-steps`` traces on every process.

``--strategy dp-tree`` sums the gradients by point-to-point exchanges
(``px.BucketedSync(algorithm="tree")``) instead of XLA's all-reduce: across CPU processes,
where the all-reduce goes through gloo, it is the faster choice (``docs/distributed.md``).

On a GPU or TPU it computes in bf16 with fp32 master parameters and optimizer
(``px.MixedPrecision``), on CPU in fp32 (``--precision`` chooses); the comparison's
tolerance is 1e-5 in fp32, 3e-2 in bf16 (the plain program computes in fp32).
"""

from __future__ import annotations

import argparse
import os
import sys

FEATURES, OUT = 32, 8


def dataset(size: int, seed: int = 0):
    """``size`` examples of a noisy nonlinear teacher, as numpy (a record per row)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    truth = rng.standard_normal((FEATURES, OUT)).astype(np.float32) / np.sqrt(FEATURES)
    x = rng.standard_normal((size, FEATURES)).astype(np.float32)
    return {"x": x, "y": np.sin(x @ truth).astype(np.float32)}


def plain_loader(data, global_batch: int, steps: int):
    """This process's shard of the data set, in batches of its share: a plain iterator."""
    import jax

    import parallax as px

    shard = {k: v[px.distributed.process_slice(len(v))] for k, v in data.items()}
    share = global_batch // jax.process_count()
    for step in range(steps):
        yield {k: v[step * share:(step + 1) * share] for k, v in shard.items()}


def global_batches(data, global_batch: int, steps: int, processes: int):
    """What the processes' shares add up to, step by step (for the one-device run)."""
    import numpy as np

    share, part = global_batch // processes, len(data["x"]) // processes
    return [{k: np.concatenate([v[p * part + s * share:p * part + (s + 1) * share]
                                for p in range(processes)]) for k, v in data.items()}
            for s in range(steps)]


def grain_loader(data, global_batch: int, steps: int):
    """The same rows through grain: a sequential sampler sharded by JAX process."""
    import grain.python as grain

    class Rows(grain.RandomAccessDataSource):
        def __len__(self):
            return len(data["x"])

        def __getitem__(self, i):
            return {k: v[i] for k, v in data.items()}

    shard = grain.ShardByJaxProcess(drop_remainder=True)
    sampler = grain.IndexSampler(len(data["x"]), shard, shuffle=False, num_epochs=1)
    per_process = global_batch // shard.shard_count
    loader = grain.DataLoader(data_source=Rows(), sampler=sampler, worker_count=0,
                              operations=[grain.Batch(per_process, drop_remainder=True)])
    for step, batch in enumerate(loader):
        if step == steps:
            return
        yield batch


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", choices=["dp", "dp-tree", "fsdp"], default="dp")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=32, help="global batch (all processes)")
    parser.add_argument("--loader", choices=["auto", "grain", "plain"], default="auto")
    from parallax.metrics import add_arguments
    from parallax.precision import add_arguments as add_precision_argument

    args = add_arguments(add_precision_argument(parser)).parse_args(argv)
    if "PARALLAX_NUM_PROCESSES" not in os.environ:
        from parallax.cli import simulate_cpu_devices

        print(simulate_cpu_devices(8))

    import parallax as px

    px.distributed.initialize()
    import jax
    import numpy as np
    import optax
    from flax import nnx

    from parallax.precision import compute_dtype_from_flag

    compute = compute_dtype_from_flag(args.precision)  # auto: bf16 on GPU/TPU, fp32 on CPU
    mesh = px.make_mesh(fsdp=-1) if args.strategy == "fsdp" else px.make_mesh(data=-1)
    strategy = {"dp": px.DataParallel("data"),
                "dp-tree": px.DataParallel("data", sync=px.BucketedSync(algorithm="tree")),
                "fsdp": px.FSDP("fsdp")}[args.strategy]
    if compute != "float32":  # float32 master parameters and optimizer
        strategy = px.compose(strategy, px.MixedPrecision(compute=compute))
    data = dataset(args.batch * args.steps)

    def make_state(dtype=compute):
        return px.TrainState.create(
            px.models.MLP(FEATURES, [64, 64], OUT, dtype=dtype, rngs=nnx.Rngs(0)),
            optax.adam(1e-2))

    state = px.init(make_state, mesh, strategy)

    @px.train_step(mesh, strategy)
    def step(state, batch):
        loss, grads = px.value_and_grad(px.models.mse_loss)(state.model, batch)
        return state.apply_gradients(grads), {"loss": loss}

    use_grain = args.loader == "grain" or (args.loader == "auto" and _has_grain())
    rows = px.distributed.process_slice(args.batch, mesh, strategy)  # its share of a batch
    loader = (grain_loader(data, args.batch, args.steps) if use_grain
              else plain_loader(data, args.batch, args.steps))
    losses = []
    matmul_params = FEATURES * 64 + 64 * 64 + 64 * OUT
    with px.metrics.Monitor(items_per_step=args.batch, unit="ex",  # bar and log: process 0
                            flops_per_step=6 * matmul_params * args.batch,
                            logdir=args.logdir, profile_steps=args.profile_steps,
                            description=f"{args.strategy} on {dict(mesh.shape)}") as monitor:
        for mine in monitor.loop(loader, total=args.steps):
            state, metrics = step(state, mine)  # each process passes its own rows
            losses.append(float(metrics["loss"]))
            monitor.step(metrics, loss=losses[-1])
    if px.distributed.is_chief():
        print(monitor.table(), flush=True)
    ref = _one_device(lambda: make_state("float32"), global_batches(data, args.batch, args.steps,
                                                 jax.process_count()))
    gap = px.testing.relative_difference(np.asarray(losses), np.asarray(ref))
    print(f"process {jax.process_index()} of {jax.process_count()}: {args.strategy} on "
          f"{dict(mesh.shape)}, {'grain' if use_grain else 'plain'} loader, rows "
          f"{rows.start}:{rows.stop} of each global batch; loss {losses[0]:.4f} -> {losses[-1]:.4f}; "
          f"relative difference vs one device (fp32) {gap:.1e} ({compute})", flush=True)
    px.distributed.shutdown()
    return 0 if gap <= (1e-5 if compute == "float32" else 3e-2) else 1


def _has_grain() -> bool:
    try:
        import grain.python  # noqa: F401
    except ImportError:
        return False
    return True


def _one_device(make_state, batches) -> list[float]:
    """The plain program on this process's first device (any process can run it)."""
    import jax
    from flax import nnx

    import parallax as px

    with jax.default_device(jax.local_devices()[0]):
        state = make_state()

        @jax.jit
        def step(state, b):
            loss, grads = jax.value_and_grad(
                lambda p: px.models.mse_loss(nnx.merge(state.graphdef, p, state.rest), b))(
                state.params)
            return state.apply_gradients(grads), loss

        losses = []
        for batch in batches:
            state, loss = step(state, batch)
            losses.append(float(loss))
    return losses


if __name__ == "__main__":
    sys.exit(main())
