"""Launched with N processes: every collective of parallax.horovod equals numpy on the
gathered inputs (an eager alltoall on a process set: among its members only, a non-member's
call refused), broadcasts make processes started with different seeds identical (DDP's
start), and the optimizer trains to the one-process numbers eagerly (on a process set too:
the members' rows) and inside @hvd.jit (buckets summed by point-to-point exchanges).

    parallax launch -np 4 python collectives.py
    parallax launch -np 2 --devices-per-process 2 python collectives.py

Every rank can rebuild every other rank's inputs (seeded by rank), so each computes the
expected result with numpy and compares. Prints ``ok NAME`` per check, then ``all agree``;
exits non-zero on the first difference.
"""

import sys

import parallax.horovod as hvd

hvd.init()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import parallax as px  # noqa: E402
from tests.horovod import adasum_reference  # noqa: E402

# eager values are per process; each stands for the process's K ranks (one per device)
RANK, SIZE = jax.process_index(), jax.process_count()
K = jax.local_device_count()


def inputs(rank, shape=(5, 3), dtype=np.float32):
    return np.random.default_rng(rank).standard_normal(shape).astype(dtype)


EVERY = np.stack([inputs(r) for r in range(SIZE)])
RANKS = np.repeat(EVERY, K, axis=0)  # one row per Horovod rank


def check(name, got, want, rtol=1e-6, exact=False):
    got, want = np.asarray(got), np.asarray(want)
    ok = got.shape == want.shape and (np.array_equal(got, want) if exact else
                                      np.allclose(got, want, rtol=rtol, atol=rtol))
    if not ok:
        print(f"DIFFER {name}: got {got.tolist()} want {want.tolist()}", flush=True)
        sys.exit(1)
    print(f"ok {name}", flush=True)


def ranks_are_devices():
    """One rank per device: size() counts what the collectives reduce over."""
    check("hvd.size() counts devices", [hvd.size(), hvd.rank(), hvd.local_size()],
          [SIZE * K, RANK * K, px.distributed.local_size() * K], exact=True)

    @hvd.jit
    def numbers(batch):
        return hvd.allgather(hvd.rank()[None]), hvd.allreduce(jnp.ones(()), op=hvd.Sum)

    ranks, ones = numbers(np.zeros((K, 1), np.float32))
    check("@hvd.jit ranks", ranks, np.arange(SIZE * K), exact=True)
    check("Sum of ones is hvd.size()", [float(ones), float(hvd.allreduce(
        np.float32(1), op=hvd.Sum))], [hvd.size(), hvd.size()], exact=True)


def eager_collectives():
    mine = inputs(RANK)
    check("allreduce sum", hvd.allreduce(mine, op=hvd.Sum), RANKS.sum(0))
    check("allreduce average", hvd.allreduce(mine), RANKS.mean(0))
    check("allreduce min", hvd.allreduce(mine, op=hvd.Min), EVERY.min(0), exact=True)
    check("allreduce max", hvd.allreduce(mine, op=hvd.Max), EVERY.max(0), exact=True)
    check("allreduce product", hvd.allreduce(mine, op=hvd.Product), RANKS.prod(0))
    check("allreduce pre/postscale", hvd.allreduce(mine, op=hvd.Sum, prescale_factor=0.5,
                                                   postscale_factor=3.0), RANKS.sum(0) * 1.5)
    rounded = RANKS.astype(np.float16).astype(np.float32)
    check("allreduce fp16", hvd.allreduce(mine, op=hvd.Sum, compression=hvd.Compression.fp16),
          rounded.sum(0).astype(np.float16).astype(np.float32), rtol=1e-3)
    wide = np.stack([inputs(r, dtype=np.float64) for r in range(SIZE)])
    check("allreduce float64", hvd.allreduce(wide[RANK], op=hvd.Sum),
          np.repeat(wide, K, axis=0).sum(0), exact=True)
    ints = np.arange(6, dtype=np.int32) * (RANK + 1)
    check("allreduce int32", hvd.allreduce(ints, op=hvd.Sum),
          np.arange(6) * sum(range(1, SIZE + 1)) * K, exact=True)
    # Horovod's integer Average: the sum scaled by 1 / size into the int32 buffer, truncated
    # toward zero (2 processes: [1, 10, -1] and [2, 21, -3] average to [1, 15, -2])
    ints = np.array([1 + RANK, 10 + 11 * RANK, -(1 + 2 * RANK)], np.int32)
    every = np.repeat(np.stack([[1 + r, 10 + 11 * r, -(1 + 2 * r)] for r in range(SIZE)]), K, 0)
    averaged = hvd.allreduce(ints)
    check("allreduce int32 average truncates", [averaged.dtype == np.int32, *averaged.tolist()],
          [True, *np.trunc(every.sum(0) / (SIZE * K)).astype(int).tolist()], exact=True)
    check("allreduce jax array", hvd.allreduce(jnp.asarray(mine)), RANKS.mean(0))
    check("allreduce adasum", hvd.allreduce(mine, op=hvd.Adasum),
          adasum_reference.adasum(list(RANKS)), rtol=1e-5)
    rows = [inputs(r, shape=(r + 1, 3)) for r in range(SIZE)]
    check("allgather ragged", hvd.allgather(rows[RANK]),
          np.concatenate([rows[r] for r in range(SIZE) for _ in range(K)]))
    for root in (0, SIZE * K - 1):  # Horovod ranks: the process holding the root sends
        check(f"broadcast from {root}", hvd.broadcast(wide[RANK], root_rank=root),
              wide[root // K], exact=True)
    if K > 1:  # each of a process's ranks would receive different parts
        try:
            hvd.alltoall(np.arange(4))
        except ValueError as error:
            check("alltoall refused eagerly", ["each of them would receive" in str(error)],
                  [True], exact=True)
        check("broadcast_object", [hvd.broadcast_object({"rank": RANK},
                                                        root_rank=SIZE * K - 1)["rank"]],
              [SIZE - 1], exact=True)
        return
    parts = np.stack([inputs(r, shape=(2 * SIZE, 3)) for r in range(SIZE)])
    check("alltoall", hvd.alltoall(parts[RANK]),
          np.concatenate([parts[s][2 * RANK:2 * RANK + 2] for s in range(SIZE)]), exact=True)
    splits = [[(s + d) % 3 + 1 for d in range(SIZE)] for s in range(SIZE)]
    sent = [inputs(s, shape=(sum(splits[s]), 2)) for s in range(SIZE)]
    got, received = hvd.alltoall(sent[RANK], splits=splits[RANK])
    starts = [np.concatenate([[0], np.cumsum(splits[s])]) for s in range(SIZE)]
    check("alltoall splits", got, np.concatenate(
        [sent[s][starts[s][RANK]:starts[s][RANK + 1]] for s in range(SIZE)]), exact=True)
    check("alltoall received splits", received, [splits[s][RANK] for s in range(SIZE)],
          exact=True)
    try:  # Horovod's core takes 32-bit splits only: torch's (and NumPy's) int64 is refused
        hvd.alltoall(sent[RANK], splits=np.asarray(splits[RANK], np.int64))
        refused = ""
    except TypeError as error:
        refused = str(error)
    check("alltoall int64 splits refused, int32 counts returned",
          [refused.startswith("hvd.alltoall: splits must hold 32-bit integers"),
           received.dtype == np.int32], [True, True], exact=True)
    check("broadcast_object", [hvd.broadcast_object({"rank": RANK}, root_rank=1)["rank"]], [1],
          exact=True)
    process_set_alltoall()


def process_set_alltoall():
    """Eagerly on a set of processes: the members exchange parts (one split per member) in a
    program of their own; a non-member's call raises, as in Horovod."""
    members = sorted({1, SIZE - 1})
    ps = hvd.add_process_set(members)
    if RANK not in members:
        for splits in (None, [1] * len(members)):
            try:
                hvd.alltoall(np.zeros((len(members), 2), np.float32), splits=splits,
                             process_set=ps)
                refused = ""
            except ValueError as error:
                refused = str(error)
            check(f"alltoall process set refused (splits={splits})", [refused.startswith(
                f"hvd.alltoall: rank {RANK} is not a member of the process set {members}")],
                [True], exact=True)
        hvd.remove_process_set(ps)
        return
    me, m = members.index(RANK), len(members)
    parts = {s: inputs(s, shape=(2 * m, 3)) for s in members}
    equal = hvd.alltoall(parts[RANK], process_set=ps)
    splits = {s: [(i + j) % 2 + 1 for j in range(m)] for i, s in enumerate(members)}
    sent = {s: inputs(10 + s, shape=(sum(splits[s]), 3)) for s in members}
    got, received = hvd.alltoall(sent[RANK], splits=splits[RANK], process_set=ps)
    starts = {s: np.concatenate([[0], np.cumsum(splits[s])]) for s in members}
    want = [parts[s][2 * me:2 * me + 2] for s in members] + [
        sent[s][starts[s][me]:starts[s][me + 1]] for s in members]
    check("alltoall process set", np.concatenate([equal, got]), np.concatenate(want),
          exact=True)
    check("alltoall process set received splits", received,
          [splits[s][me] for s in members], exact=True)
    hvd.remove_process_set(ps)


def process_set_optimizer():
    """DistributedOptimizer(process_set=) averages over the set's ranks only, eagerly and
    inside @hvd.jit: its members train on their rows together, a rank outside it on its own
    rows (eagerly a process; in the program each device)."""
    members = sorted({1, SIZE - 1})
    ps = hvd.add_process_set([p * K + i for p in members for i in range(K)])
    rng = np.random.default_rng(9)
    x = rng.standard_normal((4 * SIZE, 3)).astype(np.float32)
    y = rng.standard_normal((4 * SIZE, 1)).astype(np.float32)
    loss = lambda w, xb, yb: jnp.mean((xb @ w - yb) ** 2)  # noqa: E731
    grad = jax.jit(jax.grad(loss))

    def one_process(rows):  # plain adam on one process, 3 steps on x[rows]
        w, ref_tx = jnp.zeros((3, 1)), optax.adam(0.1)
        state = ref_tx.init(w)
        for _ in range(3):
            updates, state = ref_tx.update(grad(w, x[rows], y[rows]), state)
            w = optax.apply_updates(w, updates)
        return w

    set_rows = np.concatenate([np.arange(4 * p, 4 * p + 4) for p in members])
    own = np.arange(4 * RANK, 4 * RANK + 4)
    tx = hvd.DistributedOptimizer(optax.adam(0.1), process_set=ps)
    w = jnp.zeros((3, 1))
    state = tx.init(w)
    for _ in range(3):
        updates, state = tx.update(grad(w, x[own], y[own]), state, w)
        w = optax.apply_updates(w, updates)
    check("DistributedOptimizer process set eager", w,
          one_process(set_rows if RANK in members else own), rtol=1e-6)

    @hvd.jit
    def step(mine, batch):  # inside the program: the set's replica groups, across processes
        w, state = mine.value
        updates, state = tx.update(jax.grad(loss)(w, batch["x"], batch["y"]), state, w)
        return hvd.PerRank((optax.apply_updates(w, updates), state))

    mine = hvd.PerRank((jnp.zeros((3, 1)), tx.init(jnp.zeros((3, 1)))))
    for _ in range(3):  # this process's 4 rows, split over its K ranks
        mine = step(mine, {"x": x[own], "y": y[own]})
    shards = sorted(mine.value[0].addressable_shards, key=lambda s: s.index[0].start)
    per_device = 4 // K  # a rank outside the set trains on its device's rows alone
    check("DistributedOptimizer process set in @hvd.jit", [np.asarray(s.data)[0] for s in shards],
          [one_process(set_rows if RANK in members else own[i * per_device:(i + 1) * per_device])
           for i in range(K)], rtol=1e-6)
    hvd.remove_process_set(ps)


def program_collectives():
    """Inside @hvd.jit the ranks are every device of every process."""
    devices = jax.device_count()
    global_rows = np.arange(devices * 2 * 3, dtype=np.float32).reshape(devices * 2, 3)
    mine = global_rows[px.distributed.process_slice(devices * 2)]

    @hvd.jit
    def step(batch):  # batch: this device's 2 rows
        return (hvd.allreduce(batch, op=hvd.Sum), hvd.allreduce(batch), hvd.allgather(batch),
                hvd.broadcast(batch, root_rank=devices - 1))

    total, mean, gathered, root = step(mine)
    blocks = global_rows.reshape(devices, 2, 3)
    check("program allreduce sum", total, blocks.sum(0))
    check("program allreduce average", mean, blocks.mean(0))
    check("program allgather", gathered, global_rows, exact=True)
    check("program broadcast", root, blocks[-1], exact=True)

    @hvd.jit
    def integer_mean(batch):  # rank r: [r + 1, 10 r + 1, -(2 r + 1)]; truncated as Horovod's
        r = hvd.rank()
        return hvd.allreduce(jnp.stack([r + 1, 10 * r + 1, -(2 * r + 1)]).astype(jnp.int32))

    ranks = np.arange(devices)
    every = np.stack([ranks + 1, 10 * ranks + 1, -(2 * ranks + 1)], axis=1)
    check("program allreduce int32 average truncates", integer_mean(mine),
          np.trunc(every.sum(0) / devices), exact=True)


def ddp_start_from_rank_0():
    """Processes seeded differently end up with rank 0's parameters (DDP at construction)."""
    local = {"w": inputs(100 + RANK, shape=(4, 4)), "step": np.int32(RANK)}
    synced = hvd.broadcast_parameters(local, root_rank=0)
    check("broadcast_parameters (local)", synced["w"], inputs(100, shape=(4, 4)), exact=True)
    mesh, strategy = px.make_mesh(data=-1), px.DataParallel("data")
    state = px.init(lambda: px.TrainState.create(
        px.models.MLP(4, [8], 2, rngs=nnx.Rngs(RANK)), optax.adam(1e-3)), mesh, strategy)
    def every_copy(kernel):  # [process, local device, ...]: each device's replica
        return multihost_utils.process_allgather(
            np.stack([np.asarray(s.data) for s in kernel.addressable_shards]))

    before = every_copy(state.params["layers"][0]["kernel"])
    assert not np.array_equal(before[0, 0], before[-1, 0])  # the seeds differ
    state = hvd.broadcast_parameters(state, root_rank=0)
    everyone = every_copy(state.params["layers"][0]["kernel"])
    check("broadcast_parameters (sharded state)", everyone, np.broadcast_to(
        everyone[0, 0], everyone.shape), exact=True)


def eager_optimizer():
    """tx.update outside jit, on process-local gradients: the full-batch numbers."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((8 * SIZE, 3)).astype(np.float32)
    y = rng.standard_normal((8 * SIZE, 1)).astype(np.float32)
    loss = lambda w, xb, yb: jnp.mean((xb @ w - yb) ** 2)  # noqa: E731
    grad = jax.jit(jax.grad(loss))
    w_ref = w = jnp.zeros((3, 1))
    ref_tx, tx = optax.adam(0.1), hvd.DistributedOptimizer(optax.adam(0.1))
    ref_state, state = ref_tx.init(w_ref), tx.init(w)
    rows = px.distributed.process_slice(len(x))
    for _ in range(3):
        updates, ref_state = ref_tx.update(grad(w_ref, x, y), ref_state)
        w_ref = optax.apply_updates(w_ref, updates)
        updates, state = tx.update(grad(w, x[rows], y[rows]), state, w)
        w = optax.apply_updates(w, updates)
    check("DistributedOptimizer eager", w, w_ref, rtol=1e-6)
    # Horovod's torch step() after 1 of backward_passes_per_step=2 passes: that pass's sum
    early = hvd.DistributedOptimizer(optax.sgd(0.1), backward_passes_per_step=2)
    w = jnp.zeros((3, 1))
    updates, _ = early.update(grad(w, x[rows], y[rows]), early.init(w), w, step=True)
    check("DistributedOptimizer early step", optax.apply_updates(w, updates),
          -0.1 * grad(jnp.zeros((3, 1)), x, y), rtol=1e-6)


def program_optimizer():
    """Inside @hvd.jit, buckets summed by tree exchanges: the full-batch numbers."""
    rng = np.random.default_rng(8)
    devices = jax.device_count()
    x = rng.standard_normal((2 * devices, 3)).astype(np.float32)
    y = rng.standard_normal((2 * devices, 1)).astype(np.float32)
    loss = lambda w, xb, yb: jnp.mean((xb @ w - yb) ** 2)  # noqa: E731
    ref_tx = optax.adam(0.1)
    tx = hvd.DistributedOptimizer(optax.adam(0.1), algorithm="tree", fusion_bytes=8)

    @hvd.jit
    def step(w, state, batch):  # batch (the last argument): this device's rows
        updates, state = tx.update(jax.grad(loss)(w, batch["x"], batch["y"]), state, w)
        return optax.apply_updates(w, updates), state

    w_ref = w = jnp.zeros((3, 1))
    ref_state, state = ref_tx.init(w_ref), tx.init(w)
    rows = px.distributed.process_slice(len(x))
    for _ in range(3):
        updates, ref_state = ref_tx.update(jax.grad(loss)(w_ref, x, y), ref_state)
        w_ref = optax.apply_updates(w_ref, updates)
        w, state = step(w, state, {"x": x[rows], "y": y[rows]})
    check("DistributedOptimizer tree sum in @hvd.jit", w, w_ref, rtol=1e-6)


def batch_shapes_are_checked():
    """Processes that pass different shapes get a clear error, not a hang or garbage."""
    mesh, strategy = px.make_mesh(data=-1), px.DataParallel("data")
    rows = jax.local_device_count() * (RANK + 1)
    try:
        px.distributed.global_batch({"x": np.ones((rows, 2), np.float32)}, mesh, strategy)
    except ValueError as error:
        shapes = {p: (jax.local_device_count() * (p + 1), 2) for p in range(SIZE)}
        expected = (f"px.distributed.global_batch: the batch leaf ['x'] differs between "
                    f"processes: shapes by process {shapes} (this is process {RANK}, dtype "
                    "float32).")
        check("global_batch shape check", [str(error).startswith(expected)], [True], exact=True)
        return
    check("global_batch shape check", ["no error"], ["a ValueError"], exact=True)


def main(train: bool = False) -> None:
    ranks_are_devices()
    batch_shapes_are_checked()
    eager_collectives()
    program_collectives()
    ddp_start_from_rank_0()
    eager_optimizer()
    process_set_optimizer()
    program_optimizer()
    if train:  # the Horovod-style example against one process
        sys.path.insert(0, "examples")
        import horovod_train

        if horovod_train.main(["--steps", "3", "--check"]) != 0:
            sys.exit(1)
    print("all agree", flush=True)


if __name__ == "__main__":
    main(train="--train" in sys.argv)
    hvd.shutdown()
