"""Megatron's f/g and sequence-parallel operators: values, gradients, and the collectives."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import parallax.nn as pnn
from parallax.analysis import hlo

from .nn_testing import P, inputs, tensor_mesh

N = 4
SHAPE = (2, 8, 4)  # [batch, sequence, features]
T = "tensor"
# Each case: the local function, its in/out specs, whether its input is per-rank (stacked
# [N, *SHAPE]), and the collective its forward and its backward issue. A varying result
# is returned with a leading rank axis (out_specs P("tensor")) to see every rank's copy.
OPERATORS = {
    "copy_to_tensor": (lambda x: pnn.copy_to_tensor(x, T)[None], P(), P(T), False,
                       None, "all-reduce"),
    "reduce_from_tensor": (lambda s: pnn.reduce_from_tensor(s[0], T), P(T), P(), True,
                           "all-reduce", None),
    "scatter_to_tensor": (lambda x: pnn.scatter_to_tensor(x, T, -1), P(), P(None, None, T),
                          False, None, "all-gather"),
    "gather_from_tensor": (lambda x: pnn.gather_from_tensor(x, T, -1), P(None, None, T), P(),
                           False, "all-gather", None),
    "scatter_to_sequence": (lambda x: pnn.scatter_to_sequence(x, T), P(), P(None, T), False,
                            None, "all-gather"),
    "gather_from_sequence": (lambda x: pnn.gather_from_sequence(x, T)[None], P(None, T), P(T),
                             False, "all-gather", "reduce-scatter"),
    "reduce_scatter_to_sequence": (lambda s: pnn.reduce_scatter_to_sequence(s[0], T), P(T),
                                   P(None, T), True, "reduce-scatter", "all-gather"),
}


def _program(name, with_grad):
    local, in_spec, out_spec, *_ = OPERATORS[name]
    f = jax.shard_map(local, mesh=tensor_mesh(N), in_specs=in_spec, out_specs=out_spec)
    if not with_grad:
        return jax.jit(f)
    return jax.jit(lambda x, ct: jax.vjp(f, x)[1](ct)[0])


def _x(name):
    stacked = OPERATORS[name][3]
    return inputs((N,) + SHAPE) if stacked else inputs(SHAPE)


def _kinds(compiled):
    return sorted(c.kind for c in hlo.collectives(compiled, tensor_mesh(N)))


@pytest.mark.parametrize("name", OPERATORS)
def test_forward_and_backward_issue_megatrons_collectives(name):
    *_, forward, backward = OPERATORS[name]
    x = _x(name)
    fwd = _program(name, False)
    y = fwd(x)
    assert _kinds(fwd.lower(x).compile()) == ([forward] if forward else [])
    bwd = _program(name, True)
    kinds = _kinds(bwd.lower(x, jnp.ones_like(y)).compile())
    assert kinds == ([backward] if backward else []), kinds


def test_values_and_gradients():
    x, stacked = _x("copy_to_tensor"), _x("reduce_from_tensor")  # rank r holds stacked[r]
    ct, per_rank = inputs(SHAPE, seed=3), inputs((N,) + SHAPE, seed=4)
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)  # noqa: E731
    # f: every rank sees x; the gradient is the sum of the ranks' cotangents.
    close(_program("copy_to_tensor", False)(x), np.broadcast_to(x, (N,) + SHAPE))
    close(_program("copy_to_tensor", True)(x, per_rank), per_rank.sum(0))
    # g: the sum of the ranks' partial sums; every rank gets the cotangent.
    close(_program("reduce_from_tensor", False)(stacked), stacked.sum(0))
    close(_program("reduce_from_tensor", True)(stacked, ct), np.broadcast_to(ct, (N,) + SHAPE))
    # Split and gather are inverses, forward and backward.
    for name in ("scatter_to_tensor", "gather_from_tensor", "scatter_to_sequence"):
        close(_program(name, False)(x), x)
        close(_program(name, True)(x, ct), ct)
    # The sequence gather reduce-scatters its gradient: the ranks' cotangents are summed.
    close(_program("gather_from_sequence", False)(x), np.broadcast_to(x, (N,) + SHAPE))
    close(_program("gather_from_sequence", True)(x, per_rank), per_rank.sum(0))
    close(_program("reduce_scatter_to_sequence", False)(stacked), stacked.sum(0))
    close(_program("reduce_scatter_to_sequence", True)(stacked, ct),
          np.broadcast_to(ct, (N,) + SHAPE))


def test_operators_are_the_identity_outside_a_manual_region():
    x = inputs((2, 8, 4))
    for op in (pnn.copy_to_tensor, pnn.reduce_from_tensor, pnn.scatter_to_tensor,
               pnn.gather_from_tensor, pnn.scatter_to_sequence, pnn.gather_from_sequence,
               pnn.reduce_scatter_to_sequence):
        assert op(x, "tensor") is x
    assert not pnn.is_manual("tensor")


def test_sequence_not_divisible_names_the_fix():
    f = jax.shard_map(lambda v: pnn.scatter_to_sequence(v, "tensor"), mesh=tensor_mesh(N),
                      in_specs=P(), out_specs=P(None, "tensor"))
    with pytest.raises(ValueError, match=(
            r"px.nn.scatter_to_sequence: the activation of shape \(2, 7, 4\) has 7 positions "
            r"along dimension 1, which does not split over tensor=4 ranks; use a sequence "
            r"length that is a multiple of the tensor-parallel size")):
        jax.jit(f)(jnp.ones((2, 7, 4)))
