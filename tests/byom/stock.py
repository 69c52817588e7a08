"""Models not written for parallax (stock Flax layers, no annotations), their data, and the
plain single-device loops they are compared with."""

import jax
import numpy as np
import optax
from flax import nnx

import parallax as px
from parallax.grad.sliced_rng import is_key

STEPS = 5
TX = optax.sgd(0.1, momentum=0.9)  # momentum SGD: see docs/design.md, "Equivalence metric"


# --- a ResNet-style CNN: Conv + BatchNorm + Dropout --------------------------------------

class ResBlock(nnx.Module):
    """A residual block (one convolution: the tests compile many programs of this model)."""

    def __init__(self, channels, *, rngs):
        # No convolution bias before a BatchNorm (ResNet's choice): the mean subtraction
        # makes its gradient exactly zero, so it would train on rounding noise.
        self.conv = nnx.Conv(channels, channels, (3, 3), use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(channels, momentum=0.9, rngs=rngs)

    def __call__(self, x):
        return nnx.relu(x + self.bn(self.conv(x)))


class CNN(nnx.Module):
    def __init__(self, *, rngs, channels=8, classes=10, dropout=0.5):
        self.stem = nnx.Conv(3, channels, (3, 3), use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(channels, momentum=0.9, rngs=rngs)
        self.block = ResBlock(channels, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)
        self.head = nnx.Linear(channels, classes, rngs=rngs)

    def __call__(self, x):
        x = self.block(nnx.relu(self.bn(self.stem(x))))
        return self.head(self.drop(x.mean(axis=(1, 2))))


def cnn_loss(model, batch):
    logits = model(batch["image"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


def cnn_batches(steps=STEPS, batch=16, seed=0):
    rng = np.random.default_rng(seed)
    return [{"image": rng.standard_normal((batch, 8, 8, 3), np.float32),
             "label": rng.integers(0, 10, batch).astype(np.int32)} for _ in range(steps)]


# --- a transformer language model of stock NNX layers ------------------------------------

class MLP(nnx.Module):
    def __init__(self, d, f, *, rngs):
        self.up, self.down = nnx.Linear(d, f, rngs=rngs), nnx.Linear(f, d, rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.gelu(self.up(x)))


class Block(nnx.Module):
    def __init__(self, d, heads, f, *, rngs, dropout):
        # No attention biases: the key bias gets an exactly zero gradient (softmax cancels
        # it), so it would train on rounding noise only (docs/design.md).
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, d, use_bias=False, decode=False, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.mlp = MLP(d, f, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.drop(self.attn(self.ln1(x), mask=mask))
        return x + self.mlp(self.ln2(x))


class LM(nnx.Module):
    def __init__(self, *, rngs, vocab=32, d=16, heads=4, f=32, layers=1, dropout=0.1):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.blocks = nnx.List([Block(d, heads, f, rngs=rngs, dropout=dropout)
                                for _ in range(layers)])
        self.ln = nnx.LayerNorm(d, rngs=rngs)
        self.head = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, tokens):
        x, mask = self.embed(tokens), nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln(x))


def lm_loss(model, batch):
    tokens = batch["tokens"]
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def lm_batches(steps=STEPS, batch=8, seq=8, vocab=32):
    rng = np.random.default_rng(1)
    return [{"tokens": rng.integers(0, vocab, (batch, seq + 1)).astype(np.int32)}
            for _ in range(steps)]


LM_PLAN = {
    "blocks.*.attn": "attention",
    "blocks.*.mlp.up": "colwise",
    "blocks.*.mlp.down": "rowwise",
    "embed": "vocab",
    "head": "vocab",
}


# --- the runs ---------------------------------------------------------------------------

def key_data(tree):
    """Keys as their integer data, so that trees of state compare as numbers."""
    return jax.tree.map(lambda x: jax.random.key_data(x) if is_key(x) else x, tree)


def plain_nnx(make_model, loss_fn, batches):
    """The single-device reference: nnx.jit, nnx.value_and_grad and nnx.Optimizer."""
    model = make_model()
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss, grads

    losses, first = [], None
    for batch in batches:
        loss, grads = step(model, optimizer, batch)
        losses.append(float(loss))
        first = jax.device_get(grads) if first is None else first
    return losses, first, model, jax.device_get(nnx.state(optimizer.opt_state))


def parallax_run(make_model, loss_fn, batches, mesh, strategy, **options):
    """The same steps under ``px.train_step``; returns losses, first gradients, final state.

    The state is built once on the host and placed with ``px.shard`` (``px.init`` would
    compile the initialisers again for every mesh).
    """
    state = px.shard(px.TrainState.create(make_model(), TX), mesh, strategy)

    @px.train_step(mesh, strategy)
    def step(state, batch):
        loss, grads = px.value_and_grad(loss_fn, **options)(state.model, batch)
        return state.apply_gradients(grads), {"loss": loss, "grads": grads}

    losses, first = [], None
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        first = jax.device_get(metrics["grads"]) if first is None else first
    return losses, first, state


def assert_same_training(run, reference, rtol=1e-5):
    """Losses, first gradients, final parameters, final non-parameter state (BatchNorm
    running statistics within ``rtol``; RNG counters and keys exactly: see
    ``px.testing.relative_difference``) and, when the reference gives it, the final
    optimizer state agree."""
    losses, grads, state = run
    ref_losses, ref_grads, model, *ref_opt = reference
    diffs = {
        "losses": px.testing.relative_difference(np.asarray(losses), np.asarray(ref_losses)),
        "gradients": px.testing.relative_difference(grads, ref_grads),
        "parameters": px.testing.relative_difference(
            jax.device_get(state.params), jax.device_get(nnx.state(model, nnx.Param))),
        "state": px.testing.relative_difference(
            key_data(jax.device_get(state.rest)),
            key_data(jax.device_get(nnx.state(model, nnx.Not(nnx.Param))))),
    }
    if ref_opt:  # optax's state against nnx.Optimizer's: the same leaves in the same order
        ours, theirs = jax.tree.leaves(jax.device_get(state.opt_state)), jax.tree.leaves(ref_opt)
        assert len(ours) == len(theirs), (len(ours), len(theirs))
        diffs["optimizer state"] = px.testing.relative_difference(ours, theirs)
    assert max(diffs.values()) <= rtol, diffs
    return diffs
