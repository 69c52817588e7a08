"""Delayed scaling's float8 ``dot_general``: scales from the layer's amax history.

:class:`DelayedDot` is what ``px.Float8(delayed=True)`` gives each converted layer as its
``dot_general`` (it reads and writes that layer's own
:mod:`~parallax.strategies.float8.history` variables). The three matmuls are
:mod:`~parallax.strategies.float8.matmul`'s, tensorwise, but every operand is quantized with
the scale the layer's history gave *before* this step (Transformer Engine's
``DelayedScaling``), not with its own amax:

- forward: ``x`` and ``w`` in e4m3 with the scales of slots x and w; their amaxes are
  written into the history's slot 0 (a max with what is there: a layer called twice in a
  step records the larger);
- backward: ``g`` in e5m2 with the scale of slot g; its amax leaves the backward as the
  cotangent of the layer's :class:`~parallax.strategies.float8.history.Float8GradAmax`
  (a :class:`parallax.grad.backward_records.BackwardRecord`: a ``custom_vjp`` rule cannot
  write state, so ``px.value_and_grad`` stores that cotangent as the variable's value).

The float8 copies of ``x`` and ``w`` made for the forward are the ones the backward uses
(TE keeps them as its saved tensors). Amaxes over a batch split across the step's manual
mesh axes are max-reduced over them, so every device records one device's value. The
output gradient a device sees there is its shard's mean loss's, ``shards`` times the whole
batch's (the sync divides the summed gradients by ``shards``): its amax is recorded, and
its scale applied, divided by ``shards``, so the history and the float8 values are one
device's (exactly when ``shards`` is a power of two).

References:
  NVIDIA Transformer Engine, ``transformer_engine/pytorch/module/linear.py`` (the
  forward's and backward's casts with the recipe's scales, the amaxes recorded by the
  GEMMs) and ``common/recipe/__init__.py`` (``DelayedScaling``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from parallax import context
from parallax.comm.varying import to_varying
from parallax.strategies.float8 import scaling
from parallax.strategies.float8.matmul import _contract, batch_axes, is_dense_layout

X, W, G = 0, 1, 2  # the history's columns: input, weight, output gradient


def shared_amax(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """``max |x|`` over every element, in float32, the same on every device of ``axes``
    (not differentiated: an amax only chooses a scale)."""
    found = jnp.max(jnp.abs(lax.stop_gradient(x).astype(jnp.float32)))
    return lax.pmax(to_varying(found, axes), axes) if axes else found


class DelayedDot(nnx.Module):
    """``lax.dot_general`` with its owner layer's dense products in float8, scaled from the
    owner's history (module docstring); other products run as ``lax.dot_general``.

    A graph node holding its owner (a cycle NNX follows by reference), not a closure: under
    ``nnx.vmap``-stacked layers run by ``nnx.scan`` (``px.models.GPT``'s blocks) the owner
    it reaches inside the scan body is that layer's slice, history included.
    """

    def __init__(self, owner):
        self.owner = owner

    def __call__(self, lhs, rhs, dimension_numbers, precision=None,
                 preferred_element_type=None, **kwargs):
        if not is_dense_layout(jnp.ndim(lhs), jnp.ndim(rhs), dimension_numbers):
            return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                                   preferred_element_type=preferred_element_type, **kwargs)
        layer = self.owner
        out_dtype = preferred_element_type or jnp.result_type(lhs, rhs)
        axes = batch_axes()
        ctx = context.current()
        shards = math.prod(ctx.mesh.shape[a] for a in axes) if axes else 1
        history = layer.float8_history[...]
        found = jnp.stack([shared_amax(lhs, axes), shared_amax(rhs, axes)])
        layer.float8_history[...] = history.at[0, :G].set(jnp.maximum(history[0, :G], found))
        scale = lax.stop_gradient(layer.float8_scale[...])
        c = len(dimension_numbers[0][0])
        return _delayed_matmul(lhs, rhs, scale, layer.float8_grad_amax[...], c, out_dtype,
                               axes, shards)


def _delayed_matmul(x, w, scale, record, c, out_dtype, axes, shards):
    m = x.ndim - c
    n = w.ndim - c
    x_k, x_m = tuple(range(m, m + c)), tuple(range(m))
    w_k, w_n = tuple(range(c)), tuple(range(c, c + n))
    g_m, g_n = tuple(range(m)), tuple(range(m, m + n))
    x_dtype, w_dtype = x.dtype, w.dtype

    @jax.custom_vjp
    def matmul(x, w, scale, record):
        return forward(x, w, scale, record)[0]

    def shaped(scale, i, ndim):  # one scale per tensor, kept with the operand's rank
        return jnp.reshape(scale[i], (1,) * ndim)

    def forward(x, w, scale, record):
        sx, sw = shaped(scale, X, x.ndim), shaped(scale, W, w.ndim)
        xq = scaling.quantize(x, sx, scaling.FORWARD)
        wq = scaling.quantize(w, sw, scaling.FORWARD)
        y = _contract(xq, sx, wq, sw, x_k, w_k)
        return y.astype(out_dtype), (xq, wq, scale, record)

    def backward(saved, g):
        xq, wq, scale, record = saved
        sx, sw, sg = (shaped(scale, X, xq.ndim), shaped(scale, W, wq.ndim),
                      shaped(scale, G, g.ndim) / shards)
        gq = scaling.quantize(g, sg, scaling.BACKWARD)
        dx = _contract(gq, sg, wq, sw, g_n, w_n)  # g . w^T
        dw = _contract(xq, sx, gq, sg, x_m, g_m)  # x^T . g
        # The record's cotangent is its value after the step: the largest gradient amax.
        seen = jnp.maximum(record, shared_amax(g, axes) / shards)
        return dx.astype(x_dtype), dw.astype(w_dtype), jnp.zeros_like(scale), seen

    matmul.defvjp(forward, backward)
    return matmul(x, w, scale, record)
