"""The B/W split on one device (``px.pipeline.split_value_and_grad``): autodiff's values,
and the reference that tells a split schedule's runtime overhead from the split's."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from parallax import pipeline as pp
from parallax.testing import relative_difference

from ..runtime_testing import LOSS, TOY, Toy, toy_batch, toy_params


def test_it_is_autodiff_of_the_sequential_model():
    params, batch = toy_params(4), toy_batch()
    got = jax.jit(pp.split_value_and_grad(TOY))(params, batch)
    want = jax.jit(jax.value_and_grad(TOY))(params, batch)
    assert relative_difference(got, want) <= 1e-6


def test_a_module_and_a_checkpoint_policy():
    model, batch = Toy(), toy_batch()
    value, grads = pp.split_value_and_grad(LOSS, remat="dots_saveable")(model, batch)
    want_value, want = nnx.value_and_grad(LOSS)(model, batch)
    assert relative_difference((value, nnx.to_pure_dict(grads)),
                               (want_value, nnx.to_pure_dict(want))) <= 1e-6


def test_micro_batch_rematerialisation_is_refused():
    with pytest.raises(ValueError, match=r"px.pipeline.split_value_and_grad: remat='always' "
                       r"rematerialises micro-batches, and this program has none; use "
                       r"'never' or a jax.checkpoint_policies name"):
        pp.split_value_and_grad(TOY, remat="always")


def test_a_model_with_state_is_refused_and_keeps_it():
    class Block(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Param(jnp.eye(4))
            self.bn = nnx.BatchNorm(4, rngs=rngs)

    class Model(nnx.Module):
        def __init__(self):
            self.blocks = nnx.vmap(lambda r: Block(r), in_axes=0)(
                nnx.Rngs(0).split(2))

    loss = pp.Stages(lambda m, b: b["x"], lambda blk, x: blk.bn(x @ blk.w[...]),
                     lambda m, x, b: jnp.mean(x ** 2), lambda m: m.blocks)
    model = Model()
    before = nnx.to_pure_dict(nnx.state(model))
    with pytest.raises(ValueError, match=r"px.pipeline.split_value_and_grad: the model holds "
                       r"non-parameter state \(.*bn.*\), which this one-device reference "
                       r"does not carry"):
        pp.split_value_and_grad(loss)(model, {"x": jnp.ones((8, 4))})
    assert relative_difference(nnx.to_pure_dict(nnx.state(model)), before) == 0
