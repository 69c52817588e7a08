"""Shared models, data and strategies for the strategy tests (imported by conftest)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import parallax as px
from parallax.cli.demo import batches, demo_tokens

STEPS = 5
GPT_CONFIG = px.models.GPTConfig.tiny()


def mlp_state():
    return px.TrainState.create(px.models.MLP(16, [64, 64], 16, rngs=nnx.Rngs(0)), optax.adam(1e-2))


def mlp_step(mesh, strategy):
    """The README's step on the MLP: ``px.value_and_grad`` of the mean squared error."""
    @px.train_step(mesh, strategy)
    def step(state, batch):
        loss, grads = px.value_and_grad(px.models.mse_loss)(state.model, batch)
        return state.apply_gradients(grads), {"loss": loss}

    return step


def counted_checkpoint_reads(monkeypatch) -> list[tuple[str, int]]:
    """``(tensor name, bytes)`` of every read ``px.models.from_pretrained`` makes from then
    on (which slices each device reads)."""
    from parallax.models.pretrained import checkpoint_files

    reads = []
    original = checkpoint_files.CheckpointFiles.read

    def counting(self, name, index=None):
        array = original(self, name, index)
        reads.append((name, array.nbytes))
        return array

    monkeypatch.setattr(checkpoint_files.CheckpointFiles, "read", counting)
    return reads


def mlp_batches(steps=STEPS, batch=32):
    rng = np.random.default_rng(0)
    return [
        {"x": rng.standard_normal((batch, 16), np.float32), "y": rng.standard_normal((batch, 16), np.float32)}
        for _ in range(steps)
    ]


# A functional MLP: plain dict parameters with no annotations (ZeRO falls back to shapes).
FUNCTIONAL_TX = optax.adam(1e-2)


def functional_mlp_state():
    keys = jax.random.split(jax.random.key(0), 2)
    params = {
        "w1": jax.random.normal(keys[0], (16, 64)) / 4,
        "b1": jnp.zeros(64),
        "w2": jax.random.normal(keys[1], (64, 16)) / 8,
    }
    return params, FUNCTIONAL_TX.init(params)


def functional_mlp_loss(params, batch):
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


# Momentum SGD for the GPT: Adam divides each gradient entry by its own magnitude, so entries
# that are nearly zero (pure rounding) get full-size updates whose sign depends on the order
# of a reduction. Its parameters after a few steps are ill-conditioned in the gradients
# (measured: 2.7e-4 relative apart for data parallel, while losses agreed to 2e-7 and
# gradients to 9e-7), so Adam would test the optimizer, not the strategy. The MLP keeps Adam.
GPT_TX = optax.sgd(0.1, momentum=0.9)


def gpt_state():
    return px.TrainState.create(px.models.GPT(GPT_CONFIG, rngs=nnx.Rngs(0)), GPT_TX)


_GPT_GRAPHDEF = nnx.graphdef(px.models.GPT(GPT_CONFIG, rngs=nnx.Rngs(0)))


def functional_gpt_state():
    params = nnx.state(px.models.GPT(GPT_CONFIG, rngs=nnx.Rngs(0)), nnx.Param)
    return params, GPT_TX.init(params)


def functional_gpt_loss(params, batch):
    return px.models.next_token_loss(nnx.merge(_GPT_GRAPHDEF, params), batch)


def gpt_batches(steps=STEPS, batch=16):
    return list(batches(demo_tokens(), batch, GPT_CONFIG.max_seq_len, steps))


# name -> (mesh axes, devices used, strategy)
STRATEGIES = {
    "dp": ({"data": 8}, px.DataParallel("data")),
    "dp-gspmd": ({"data": 8}, px.DataParallel("data", style="gspmd")),
    "zero1": ({"fsdp": 8}, px.ZeRO(1, "fsdp")),
    "zero2": ({"fsdp": 8}, px.ZeRO(2, "fsdp")),
    "zero3": ({"fsdp": 8}, px.ZeRO(3, "fsdp")),
    "zero3-gspmd": ({"fsdp": 8}, px.ZeRO(3, "fsdp", style="gspmd")),
    "hsdp": ({"data": 2, "fsdp": 4}, px.HSDP("data", "fsdp")),
    "tp": ({"tensor": 4, "_devices": 4}, px.TensorParallel("tensor")),
    "dp-tp": ({"data": 2, "tensor": 4}, px.compose(px.DataParallel("data"), px.TensorParallel("tensor"))),
    "dp-fsdp-tp": (
        {"data": 2, "fsdp": 2, "tensor": 2},
        px.compose(px.DataParallel("data"), px.FSDP("fsdp"), px.TensorParallel("tensor")),
    ),
    "dp-accumulate": ({"data": 8}, px.compose(px.DataParallel("data"), px.GradientAccumulation(2))),
}


def mesh_for(name):
    axes, strategy = STRATEGIES[name]
    axes = dict(axes)
    count = axes.pop("_devices", None)
    devices = jax.devices()[:count] if count else None
    return px.make_mesh(devices=devices, **axes), strategy


KINDS = {
    "mlp": (mlp_state, px.models.mse_loss, mlp_batches, None),
    "functional-mlp": (functional_mlp_state, functional_mlp_loss, mlp_batches, FUNCTIONAL_TX),
    "gpt": (gpt_state, px.models.next_token_loss, gpt_batches, None),
    "functional-gpt": (functional_gpt_state, functional_gpt_loss, gpt_batches, GPT_TX),
}


@functools.cache
def reference(kind):
    """(make_state, loss_fn, batches, tx, single-device trajectory), computed once per kind."""
    make, loss, data_fn, tx = KINDS[kind]
    data = data_fn()
    return make, loss, data, tx, px.testing.train(make, loss, data, tx=tx)
