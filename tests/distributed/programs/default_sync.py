"""Launched with 2 processes x 1 CPU device: the default gradient sum across processes.

    parallax launch -np 2 python default_sync.py [--steps 3]

``px.DataParallel("data")`` over a mesh whose data axis spans the two processes sums each
gradient by an exchange (``collective-permute``), and ``sync="xla"`` by XLA's all-reduce.
For each, this checks the compiled program (the collectives, and ``px.explain``'s line
and traffic rows) and trains a stock Flax model (``nnx.Conv``, ``nnx.LayerNorm``,
``nnx.Linear``; Adam) for ``--steps`` steps, each process feeding only its rows, comparing
the whole state (parameters, Adam's moments, the step count) after every step and the losses
with a plain ``jax.jit`` run of the full batches on one of its own devices. Prints one
``agree`` line per sync and exits non-zero on any difference.
"""

import argparse
import json
import sys

import parallax as px

px.distributed.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from parallax.analysis import hlo  # noqa: E402

TOLERANCE = 1e-5


class Net(nnx.Module):
    def __init__(self, rngs):
        self.conv = nnx.Conv(3, 4, kernel_size=(3, 3), rngs=rngs)
        self.norm = nnx.LayerNorm(4, rngs=rngs)
        self.out = nnx.Linear(4 * 6 * 6, 5, rngs=rngs)

    def __call__(self, x):
        h = nnx.relu(self.norm(self.conv(x)))
        return self.out(h.reshape(h.shape[0], -1))


def make_state():
    return px.TrainState.create(Net(nnx.Rngs(0)), optax.adam(1e-2))


def loss_fn(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()


def batches(steps, rows=16):
    rng = np.random.default_rng(0)
    return [{"x": rng.standard_normal((rows, 6, 6, 3), np.float32),
             "y": rng.integers(0, 5, rows).astype(np.int32)} for _ in range(steps)]


def reference(data):
    """Losses and the whole state after each step: full batches, jax.jit, one local device."""
    with jax.default_device(jax.local_devices()[0]):
        state = make_state()

        @jax.jit
        def step(state, batch):
            loss, grads = jax.value_and_grad(lambda p: loss_fn(
                nnx.merge(state.graphdef, p, state.rest), batch))(state.params)
            return state.apply_gradients(grads), loss

        out = []
        for batch in data:
            state, loss = step(state, batch)
            out.append((float(loss), jax.device_get(state)))
    return out


def check_program(step, state, batch, mesh, sync):
    """The collectives the sum compiled to, and what px.explain says of them."""
    found = hlo.collectives(step.lower(state, batch).compile(), mesh)
    grads = jax.tree.leaves(state.params)
    grad_bytes = 4 * sum(x.size for x in grads)
    permuted = [c for c in found if c.kind == "collective-permute"]
    reduced = sum(c.message_bytes for c in found if c.kind == "all-reduce"
                  and c.message_bytes > 4)  # the loss's scalar is psum'd in both
    if sync is None:  # one exchange of every gradient between the two processes
        assert len(permuted) == len(grads), [str(c) for c in found]
        assert sum(c.message_bytes for c in permuted) == grad_bytes and reduced == 0
    else:  # XLA's all-reduce of every gradient (and the loss, combined)
        assert not permuted and reduced == grad_bytes + 4, [str(c) for c in found]
    report = px.explain(step, state, batch)
    line = report.facts["gradient sync"]
    expected = ("AllReduceSync(algorithm='tree'): the default for CPU devices in several "
                "processes" if sync is None else "AllReduceSync(algorithm='xla') (the "
                "strategy's)")
    assert line.startswith(expected), line
    traffic = [r for r in report.rows if r.section == "collectives per step"]
    assert traffic and not [r.name for r in traffic if r.flagged], report.text()
    return {"permutes": len(permuted), "all-reduce bytes": reduced, "explain": line[:40]}


def train(data, sync, steps):
    mesh = px.make_mesh(data=2)
    strategy = px.DataParallel("data", sync=sync)
    state = px.init(make_state, mesh, strategy)

    @px.train_step(mesh, strategy)
    def step(state, batch):
        loss, grads = px.value_and_grad(loss_fn)(state.model, batch)
        return state.apply_gradients(grads), {"loss": loss}

    rows = px.distributed.process_slice(len(data[0]["y"]), mesh, strategy)
    program = check_program(step, state, jax.tree.map(lambda x: x[rows], data[0]), mesh, sync)
    out = []
    for batch in data[:steps]:
        state, metrics = step(state, jax.tree.map(lambda x: x[rows], batch))
        out.append((float(metrics["loss"]), multihost_utils.process_allgather(state,
                                                                              tiled=True)))
    return out, program


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    assert jax.process_count() == 2 and jax.local_device_count() == 1, (
        jax.process_count(), jax.local_device_count())
    data = batches(args.steps)
    ref = reference(data)
    failures, runs = 0, {}
    for sync in (None, "xla"):
        run, program = train(data, sync, args.steps)
        runs[sync] = run
        losses = px.testing.relative_difference(np.asarray([r[0] for r in run]),
                                                np.asarray([r[0] for r in ref]))
        states = max(px.testing.relative_difference(jax.tree.leaves(mine), jax.tree.leaves(theirs))
                     for (_, mine), (_, theirs) in zip(run, ref))
        result = {"sync": repr(sync), "losses": losses, "whole state": states, **program}
        ok = max(losses, states) <= TOLERANCE
        failures += not ok
        print(("agree " if ok else "DIFFER ") + json.dumps(result), flush=True)
    # the choice of sum changes the numbers by no more than the order of fp32 additions
    between = px.testing.relative_difference(jax.tree.leaves(runs[None][-1][1]),
                                             jax.tree.leaves(runs["xla"][-1][1]))
    print(("agree " if between <= 1e-6 else "DIFFER ")
          + json.dumps({"sync": "tree vs xla", "whole state": between}), flush=True)
    failures += between > 1e-6
    px.distributed.shutdown()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
