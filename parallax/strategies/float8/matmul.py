"""A float8 ``dot_general``: e4m3 operands forward, e5m2 gradients backward, float32 sums.

:func:`float8_dot_general` returns a function with ``lax.dot_general``'s signature, which
``nnx.Linear(dot_general=...)`` and ``parallax.nn.Dense`` call. Its three matmuls are
each a ``dot_general`` on float8 operands with a float32 result, then divided by the two
scales (as Transformer Engine's and torchao's scaled GEMMs, ``torch._scaled_mm``):

- forward ``y = x . w``: ``x`` and ``w`` in e4m3;
- input gradient ``dx = g . w^T``: ``g`` in e5m2, ``w`` in e4m3;
- weight gradient ``dw = x^T . g``: ``x`` in e4m3, ``g`` in e5m2.

Each operand is scaled over the dimensions its matmul contracts (rowwise: one scale per
row of the other dimensions, torchao's ``ROWWISE``, which scales the weight gradient's
operands along the tokens) or over all of them (tensorwise). An amax over the tokens of
a batch split over manual mesh axes (inside ``px.value_and_grad``'s ``shard_map``) is
max-reduced over them, so each device quantizes with the scale one device would use on
the whole batch. Quantization is a straight-through estimator: the gradients are those
of ``x . w`` computed from the float8 operands.

Only the layout of dense layers is converted: no batch dimensions, ``x``'s trailing
dimensions contracted with ``w``'s leading ones in order; any other ``dot_general`` runs
as ``lax.dot_general``.

References:
  Micikevicius et al., "FP8 Formats for Deep Learning", 2022; NVIDIA Transformer Engine
  (``Format.HYBRID``); torchao ``torchao/float8/float8_linear.py`` (``matmul_with_hp_or_float8_args``:
  the three GEMMs and which operand is cast how for each).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from parallax import context
from parallax.strategies.float8 import scaling
from parallax.strategies.float8.recipe import Float8Recipe


def batch_axes() -> tuple[str, ...]:
    """The manual mesh axes that split the batch where the trace is (none outside a step)."""
    ctx = context.current()
    if ctx is None:
        return ()
    return tuple(a for a in ctx.strategy.batch_axes if a in ctx.manual_axes)


def is_dense_layout(lhs_ndim: int, rhs_ndim: int, dimension_numbers) -> bool:
    """Whether ``dimension_numbers`` contract ``lhs``'s trailing dims with ``rhs``'s leading
    ones, in order, without batch dims (``nnx.Linear``, ``jnp.tensordot``)."""
    (lhs_c, rhs_c), (lhs_b, rhs_b) = dimension_numbers
    c = len(lhs_c)
    return (not lhs_b and not rhs_b and c == len(rhs_c) and 0 < c <= min(lhs_ndim, rhs_ndim)
            and tuple(lhs_c) == tuple(range(lhs_ndim - c, lhs_ndim))
            and tuple(rhs_c) == tuple(range(c)))


def _scaled(x, dims, dtype, recipe: Float8Recipe, axes):
    """``x`` in ``dtype`` and its scale, the amax taken over ``dims`` (all dims when the
    recipe is tensorwise) and over ``axes``."""
    dims = tuple(range(x.ndim)) if recipe.scaling == "tensorwise" else tuple(dims)
    found = scaling.amax(x, dims, axes)
    scale = scaling.scale_from_amax(found, dtype, recipe.power_of_2_scales)
    return scaling.quantize(x, scale, dtype), scale


def _contract(a_q, a_scale, b_q, b_scale, a_dims, b_dims):
    """``a . b`` over ``a_dims`` x ``b_dims`` (float32), divided by both scales; the free
    dims of ``a`` come first, then ``b``'s, and each scale is constant along its operand's
    contracted dims, so it factors out of the sum."""
    out = lax.dot_general(a_q, b_q, ((a_dims, b_dims), ((), ())),
                          preferred_element_type=jnp.float32)
    a_free = [d for d in range(a_q.ndim) if d not in a_dims]
    b_free = [d for d in range(b_q.ndim) if d not in b_dims]
    a_s = jnp.reshape(jnp.moveaxis(a_scale, a_free, range(len(a_free))),
                      tuple(a_scale.shape[d] for d in a_free) + (1,) * len(b_free))
    b_s = jnp.reshape(jnp.moveaxis(b_scale, b_free, range(len(b_free))),
                      (1,) * len(a_free) + tuple(b_scale.shape[d] for d in b_free))
    return out / a_s / b_s


def float8_dot_general(recipe: Float8Recipe):
    """``lax.dot_general`` with its dense-layer products in float8 (module docstring).

    Example:
      >>> import jax.numpy as jnp
      >>> dot = float8_dot_general(Float8Recipe())
      >>> x, w = jnp.ones((4, 16)), jnp.full((16, 8), 0.5)
      >>> round(float(dot(x, w, (((1,), (0,)), ((), ())))[0, 0]), 4)
      8.0
    """

    def dot_general(lhs, rhs, dimension_numbers, precision=None,
                    preferred_element_type=None, **kwargs):
        if not is_dense_layout(jnp.ndim(lhs), jnp.ndim(rhs), dimension_numbers):
            return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                                   preferred_element_type=preferred_element_type, **kwargs)
        out_dtype = preferred_element_type or jnp.result_type(lhs, rhs)
        c = len(dimension_numbers[0][0])
        m = jnp.ndim(lhs) - c
        axes = batch_axes()
        return _float8_matmul(lhs, rhs, c, m, out_dtype, recipe, axes)

    return dot_general


def _float8_matmul(x, w, c, m, out_dtype, recipe, axes):
    n = w.ndim - c
    x_k, x_m = tuple(range(m, m + c)), tuple(range(m))
    w_k, w_n = tuple(range(c)), tuple(range(c, c + n))
    g_m, g_n = tuple(range(m)), tuple(range(m, m + n))
    fwd_e4m3, bwd_e5m2 = scaling.FORWARD, scaling.BACKWARD
    tensorwise = recipe.scaling == "tensorwise"

    @jax.custom_vjp
    def matmul(x, w):
        return forward(x, w)[0]

    def forward(x, w):
        xq, xs = _scaled(x, x_k, fwd_e4m3, recipe, axes if tensorwise else ())
        wq, ws = _scaled(w, w_k, fwd_e4m3, recipe, ())
        y = _contract(xq, xs, wq, ws, x_k, w_k)
        return y.astype(out_dtype), (x, w)

    def backward(saved, g):
        x, w = saved
        # dx = g . w^T: contract the output dims.
        gq, gs = _scaled(g, g_n, bwd_e5m2, recipe, axes if tensorwise else ())
        wq, ws = _scaled(w, w_n, fwd_e4m3, recipe, ())
        dx = _contract(gq, gs, wq, ws, g_n, w_n)
        # dw = x^T . g: contract the tokens, whose amax spans the whole batch.
        xq, xs = _scaled(x, x_m, fwd_e4m3, recipe, axes)
        if not tensorwise:
            gq, gs = _scaled(g, g_m, bwd_e5m2, recipe, axes)
        dw = _contract(xq, xs, gq, gs, x_m, g_m)
        return dx.astype(x.dtype), dw.astype(w.dtype)

    matmul.defvjp(forward, backward)
    return matmul(x, w)
