"""Shared pieces of the checkpoint tests: tiny states, steps that continue a run, layouts."""

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

import fixtures as fx
import parallax as px
from parallax import layout

GPT_LOSS = px.models.next_token_loss
STAGES_LOSS = px.models.next_token_stages


def stepper(mesh, strategy, loss_fn):
    """A train step for ``mesh``/``strategy``, or a plain ``jax.jit`` one when mesh is None."""
    if mesh is None:
        @jax.jit
        def plain(state, batch):
            loss, grads = jax.value_and_grad(
                lambda p: loss_fn(nnx.merge(state.graphdef, p, state.rest), batch)
            )(state.params)
            return state.apply_gradients(grads), {"loss": loss}
        return plain

    @px.train_step(mesh, strategy)
    def step(state, batch):
        loss, grads = px.value_and_grad(loss_fn)(state.model, batch)
        return state.apply_gradients(grads), {"loss": loss}
    return step


def run(step, state, batches):
    """(state, losses as float32 numpy) after one step per batch."""
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(np.asarray(metrics["loss"]))
    return state, np.array(losses)


def assert_layout(state, mesh, strategy, make=fx.gpt_state):
    """Every leaf of ``state`` sits exactly where the strategy puts it on ``mesh``."""
    abstract = jax.eval_shape(make)
    if mesh is None:
        device = jax.devices()[0]
        for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
            assert leaf.sharding.device_set == {device}, jax.tree_util.keystr(path)
        return
    want = jax.tree.leaves(layout.state_shardings(abstract, strategy, mesh, "test"))
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    assert len(flat) == len(want)
    for (path, leaf), sharding in zip(flat, want):
        where = jax.tree_util.keystr(path)
        assert isinstance(leaf.sharding, NamedSharding), where
        assert leaf.sharding.mesh == mesh, where
        assert leaf.sharding.spec == sharding.spec, (where, leaf.sharding.spec, sharding.spec)
        shard_shape = sharding.shard_shape(leaf.shape)
        assert all(s.data.shape == shard_shape for s in leaf.addressable_shards), where


def host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def assert_bitwise(a, b):
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(host(a))[0],
                            jax.tree.leaves(host(b)), strict=True):
        np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))


class WindowSampler:
    """Random windows of the demo text, resumable from ``state()`` (a JSON-able dict).

    Its position is a NumPy generator's state, the kind of thing ``extra`` carries.
    """

    def __init__(self, batch, seed=0, state=None):
        self.tokens = fx.demo_tokens()
        self.batch, self.rng, self.position = batch, np.random.default_rng(seed), 0
        if state is not None:
            self.rng.bit_generator.state = state["rng"]
            self.position = state["position"]

    def state(self):
        return {"rng": self.rng.bit_generator.state, "position": self.position}

    def next(self):
        seq = fx.GPT_CONFIG.max_seq_len
        starts = self.rng.integers(0, len(self.tokens) - seq - 1, size=self.batch)
        self.position += 1
        return {"tokens": np.stack([self.tokens[s : s + seq + 1] for s in starts])}


# name -> (mesh axes, devices, strategy, loss): the layouts the bitwise resume covers
RESUMABLE = {
    "dp-fsdp-tp": (dict(data=2, fsdp=2, tensor=2), 8,
                   px.compose(px.DataParallel("data"), px.FSDP("fsdp"),
                              px.TensorParallel("tensor")), GPT_LOSS),
    "pp-1f1b": (dict(stage=2, data=2), 4,
                px.compose(px.DataParallel("data"),
                           px.Pipeline("stage", microbatches=2, schedule="1f1b")), STAGES_LOSS),
}


def resumable(name):
    """(mesh, strategy, step) of a :data:`RESUMABLE` configuration."""
    axes, count, strategy, loss_fn = RESUMABLE[name]
    mesh = px.make_mesh(**axes, devices=jax.devices()[:count])
    return mesh, strategy, stepper(mesh, strategy, loss_fn)
