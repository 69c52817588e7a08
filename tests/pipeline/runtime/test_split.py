"""A layer's backward split into B and W: exact, and each weight gradient computed once."""

import functools
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import parallax as px
from parallax.models.gpt_pipeline import apply_block
from parallax.pipeline.runtime.chunk import template
from parallax.pipeline.runtime.constants import constant_outputs
from parallax.analysis.executed import executed_cost
from parallax.pipeline.runtime.split import split


@functools.cache
def gpt_block():
    model = px.models.GPT(px.models.GPTConfig.tiny(), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model.blocks, nnx.Param)
    leaves, treedef = jax.tree.flatten(jax.tree.map(lambda v: v[0], state))

    def layer(p, x):
        return apply_block(nnx.merge(graphdef, jax.tree.unflatten(treedef, p)), x)

    x = jax.random.normal(jax.random.key(0), (4, 64, 64))
    return layer, leaves, x, split(layer, leaves, x, "test")


def pieces(s, params, x, dy):
    """F, B and W as the runtime composes them; returns (y, dx, dparams)."""
    eps = [jnp.zeros(e.shape, e.dtype) for e in s.eps_like]
    y, pullback, operands = jax.vjp(lambda x, eps: s.forward(params, x, eps), x, eps,
                                    has_aux=True)
    dx, d_uses = pullback(dy)
    _, weights = jax.vjp(lambda p: s.uses(p, operands), params)
    return y, dx, weights([d_uses[k] for k in s.gradient_of])[0]


@pytest.mark.slow
def test_b_and_w_together_are_the_layers_vjp():
    layer, params, x, s = gpt_block()
    dy = jax.random.normal(jax.random.key(1), x.shape)
    y, dx, dw = jax.jit(functools.partial(pieces, s))(params, x, dy)
    ry, pullback = jax.vjp(layer, params, x)
    rdw, rdx = pullback(dy)
    assert px.testing.relative_difference((y, dx, dw), (ry, rdx, rdw)) <= 1e-6


def test_each_use_of_a_parameter_has_one_gradient_and_bias_adds_share_it():
    _, _, _, s = gpt_block()
    uses = sum(e.side == "use" for e in s.eqns)
    # 13 uses (LayerNorm scales and biases, QKV, q/v biases, out, fc, proj and biases);
    # a bias added to a matmul's (or a scale's) only output shares its gradient
    assert (uses, len(s.eps_like), len(s.gradient_of)) == (13, 8, 13)
    assert len(s.use_inputs) == 6  # the activations W reads (bias adds read none)


@pytest.mark.slow
def test_w_does_not_walk_the_chain_again():
    """From the compiled programs: B and W (each its own program, as in the runtime's
    switch) cost what the backward of one vjp costs; a W from the layer's own vjp would
    walk the chain of input gradients again."""
    layer, params, x, s = gpt_block()
    dy = jnp.ones_like(x)
    eps = [jnp.zeros(e.shape, e.dtype) for e in s.eps_like]

    def flops(fn, *args):
        return executed_cost(jax.jit(fn).lower(*args).compile()).flops

    def forward_and_b(p, x, dy):
        _, pullback, operands = jax.vjp(lambda x, e: s.forward(p, x, e), x, eps, has_aux=True)
        return pullback(dy), operands

    (_, d_uses), operands = jax.jit(forward_and_b)(params, x, dy)
    forward = flops(layer, params, x)
    backward = flops(lambda p, x, dy: jax.vjp(layer, p, x)[1](dy), params, x, dy) - forward
    b = flops(forward_and_b, params, x, dy) - forward
    w = flops(lambda p, o, g: jax.vjp(lambda q: s.uses(q, o), p)[1](
        [g[k] for k in s.gradient_of]), params, operands, d_uses)
    naive_w = flops(lambda p, x, dy: jax.vjp(lambda q: layer(q, x), p)[1](dy), params, x, dy)
    assert b + w <= 1.01 * backward  # each weight gradient once, no second chain
    assert naive_w - forward > 0.9 * backward  # the naive W redoes nearly all of it


def test_a_layer_output_must_depend_on_its_input():
    with pytest.raises(ValueError, match=re.escape(
            "test: an output of Stages.stage(layer, x) depends on the layer's parameters "
            "only, not on x")):
        split(lambda p, x: p[0] * 2.0, [jnp.ones(3)], jnp.ones(3), "test")


@pytest.mark.slow
def test_what_no_input_makes_is_not_stashed():
    """The attention's causal mask is a residual of the layer's vjp that no input flows
    into: F keeps it out of the stash (every micro-batch and layer would write and read
    the same mask), and B and W take the template's one value."""
    layer, params, x, _ = gpt_block()
    tmpl = template(lambda p, x, s: (layer(p, x), s), params, x, lambda v: v, None, "test")
    masks = [v for v in tmpl.constants.values() if v.dtype == jnp.bool_]
    assert masks and all(m.shape[-2:] == (64, 64) for m in masks)
    assert all(jnp.issubdtype(a.dtype, jnp.floating) for a in tmpl.stashed)
    assert len(tmpl.stashed) == len(tmpl.residuals) + len(tmpl.operands) - len(
        tmpl.same_as) - len(tmpl.constants)


def test_constant_outputs_follow_every_input():
    def fn(x, y):
        inner = jax.jit(lambda a: a * 2)(x)  # a nested jaxpr counts whole
        return inner, jnp.arange(3) < 2, jnp.zeros(2), y[0], 5.0
    assert constant_outputs(fn, jnp.ones(2), jnp.ones(2)) == {1, 2, 4}
