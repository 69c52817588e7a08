"""Launched with 2 processes x 2 devices: five strategies train to the one-device numbers.

    parallax launch -np 2 --devices-per-process 2 python strategies.py [--steps 3]

DataParallel (data=4), DataParallel whose gradients are summed by point-to-point
exchanges (``px.BucketedSync(algorithm="tree")``), ZeRO 3 (fsdp=4), DP x TP (data=2 across the processes x tensor=2
inside each) and a 1F1B pipeline whose stage axis spans the two processes (stage=2 x
data=2). Each process loads only its rows of every global batch
(``px.distributed.process_slice``) and passes it to the step, which assembles the global
batch, and compares the losses and the final parameters
(gathered from every process) with a plain ``jax.jit`` run of the full batches on one of its
own devices. Prints one ``agree`` line per strategy and exits non-zero on any difference.
"""

import argparse
import json

import parallax as px

px.distributed.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from parallax.cli.demo import batches, demo_tokens  # noqa: E402

TOLERANCE = 1e-6
GPT = px.models.GPTConfig.tiny()


def mlp_state():
    return px.TrainState.create(px.models.MLP(16, [64, 64], 16, rngs=nnx.Rngs(0)),
                                optax.adam(1e-2))


def gpt_state():
    return px.TrainState.create(px.models.GPT(GPT, rngs=nnx.Rngs(0)), optax.sgd(0.1, 0.9))


def mlp_data(steps, rows=16):
    rng = np.random.default_rng(0)
    return [{"x": rng.standard_normal((rows, 16), np.float32),
             "y": rng.standard_normal((rows, 16), np.float32)} for _ in range(steps)]


def reference(make_state, loss_fn, data):
    """The plain program: full batches, jax.jit, one local device."""
    with jax.default_device(jax.local_devices()[0]):
        state = make_state()

        @jax.jit
        def step(state, batch):
            loss, grads = jax.value_and_grad(
                lambda p: loss_fn(nnx.merge(state.graphdef, p, state.rest), batch))(state.params)
            return state.apply_gradients(grads), loss

        losses = []
        for batch in data:
            state, loss = step(state, batch)
            losses.append(float(loss))
    return losses, jax.device_get(state.params)


def parallel(make_state, loss_fn, data, mesh, strategy):
    """The same steps across the processes, each feeding only its own rows."""
    state = px.init(make_state, mesh, strategy)

    @px.train_step(mesh, strategy)
    def step(state, batch):
        loss, grads = px.value_and_grad(loss_fn)(state.model, batch)
        return state.apply_gradients(grads), {"loss": loss}

    rows = px.distributed.process_slice(len(jax.tree.leaves(data[0])[0]), mesh, strategy)
    losses = []
    for batch in data:
        mine = jax.tree.map(lambda x: x[rows], batch)
        state, metrics = step(state, mine)  # each process passes its own rows
        losses.append(float(metrics["loss"]))
    return losses, multihost_utils.process_allgather(state.params, tiled=True), rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--horovod", action="store_true",
                        help="then run tests/horovod/programs/collectives.py's checks too")
    args = parser.parse_args()
    assert jax.process_count() == 2 and jax.local_device_count() == 2, (
        jax.process_count(), jax.local_device_count())
    mlp, gpt = mlp_data(args.steps), list(batches(demo_tokens(), 8, GPT.max_seq_len, args.steps))
    mse, tokens = px.models.mse_loss, px.models.next_token_loss
    cases = [
        ("DataParallel", px.make_mesh(data=4), px.DataParallel("data"), mlp_state, mse, mlp),
        ("ZeRO 3", px.make_mesh(fsdp=4), px.ZeRO(3, "fsdp"), mlp_state, mse, mlp),
        ("DDP point-to-point", px.make_mesh(data=4),
         px.DataParallel("data", sync=px.BucketedSync(algorithm="tree")), mlp_state, mse, mlp),
        ("DP x TP", px.make_mesh(data=2, tensor=2),
         px.compose(px.DataParallel("data"), px.TensorParallel("tensor")), mlp_state, mse, mlp),
        ("1F1B over processes", px.make_mesh(stage=2, data=2),
         px.compose(px.DataParallel("data"), px.Pipeline("stage", microbatches=2,
                                                         schedule="1f1b")),
         gpt_state, px.models.next_token_stages, gpt),
    ]
    failures, references = [], {}
    for name, mesh, strategy, make_state, loss_fn, data in cases:
        if make_state not in references:  # one plain program per model
            references[make_state] = reference(make_state, mse if loss_fn is mse else tokens,
                                               data)
        ref_losses, ref_params = references[make_state]
        losses, params, rows = parallel(make_state, loss_fn, data, mesh, strategy)
        result = {
            "strategy": name, "mesh": dict(mesh.shape), "rows": [rows.start, rows.stop],
            "losses": px.testing.relative_difference(np.asarray(losses), np.asarray(ref_losses)),
            "params": px.testing.relative_difference(params, ref_params),
        }
        ok = max(result["losses"], result["params"]) <= TOLERANCE
        print(("agree " if ok else "DIFFER ") + json.dumps(result), flush=True)
        if not ok:
            failures.append(name)
    if failures:
        raise SystemExit(f"differ from one device: {failures}")
    if args.horovod:  # the same 2 x 2 processes: Horovod's collectives and training too
        from tests.horovod.programs import collectives

        collectives.main(train=True)
    px.distributed.shutdown()


if __name__ == "__main__":
    main()
