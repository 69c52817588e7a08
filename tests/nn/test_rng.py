"""Random streams under tensor parallelism: Megatron's tracker, and dropout equal to one device.

Threefry keys (JAX's default) throughout. Its partitionable variant (the default) takes
XLA CPU seconds to compile per program, so these tests use the classic variant
(``jax.threefry_partitionable(False)``): same key and shape give the same bits in both, which
is all that the masks rely on.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import parallax.nn as pnn
from parallax.nn import rng

from .nn_testing import P, compare, inputs, tensor_mesh

KEY = jax.random.key(0)
T = "tensor"


@pytest.fixture(autouse=True)
def classic_threefry():
    with jax.threefry_partitionable(False):
        yield
SHAPE = (2, 8, 4, 16)  # e.g. [batch, sequence, heads, features]


def _local(dim):
    shape = list(SHAPE)
    shape[dim] //= 4
    return tuple(shape)


def test_masks_agree_where_replicated_and_are_the_one_device_slices_where_sharded():
    def per_rank():
        return (rng.keep_mask(KEY, SHAPE, 0.5)[None],  # replicated: one copy per rank
                rng.keep_mask(KEY, _local(1), 0.3, sharded_dim=1),  # sequence split
                rng.keep_mask(KEY, _local(2), 0.3, sharded_dim=2),  # heads split
                jax.random.bits(pnn.rank_key(KEY, T), (4,))[None])  # Megatron's rank stream

    f = jax.shard_map(per_rank, mesh=tensor_mesh(4), in_specs=(),
                      out_specs=(P(T), P(None, T), P(None, None, T), P(T)))
    replicated, by_sequence, by_heads, rank_bits = jax.jit(f)()
    one_device = jax.jit(lambda: (rng.keep_mask(KEY, SHAPE, 0.5),
                                  rng.keep_mask(KEY, SHAPE, 0.3, sharded_dim=1),
                                  rng.keep_mask(KEY, SHAPE, 0.3, sharded_dim=2)))()
    for mask in replicated:
        np.testing.assert_array_equal(mask, one_device[0])
    np.testing.assert_array_equal(by_sequence, one_device[1])
    np.testing.assert_array_equal(by_heads, one_device[2])
    assert 0.6 < float(one_device[1].mean()) < 0.8  # keep probability 0.7
    assert len({np.asarray(row).tobytes() for row in rank_bits}) == 4


def test_dropout_scales_kept_values_and_is_the_identity_when_off():
    x = jnp.ones((4, 64))
    y = jax.jit(lambda v: pnn.dropout(v, 0.25, KEY))(x)
    assert set(np.unique(y).tolist()) == {0.0, float(np.float32(1 / 0.75))}
    assert pnn.dropout(x, 0.25, None) is x and pnn.dropout(x, 0.0, KEY) is x
    with pytest.raises(ValueError, match=r"px.nn.dropout: rate=1.0 must be in \[0, 1\); use 0 "
                                         r"for no dropout."):
        pnn.dropout(x, 1.0, KEY)


@pytest.mark.slow
def test_attention_dropout_under_tensor_parallelism_equals_one_device():
    # Probabilities are dropped per global head, so tensor=2 and 4 draw the masks one device
    # draws: outputs and gradients agree although dropout is on.
    attn = pnn.ParallelSelfAttention(32, 8, num_kv_heads=2, dropout_rate=0.2,
                                     rngs=nnx.Rngs(0))
    x = inputs((2, 8, 32))
    dense = compare(attn, x, call=lambda m, v: m(v, dropout_key=KEY))
    assert not np.allclose(dense[0], attn(x), atol=1e-3)  # dropout did something
