"""Sliced keys draw one device's values for a block of rows, at the cost of the block."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parallax.grad import sliced_rng

KEY = jax.random.key(7)


@pytest.mark.parametrize("draw", [
    lambda k, s: jax.random.bernoulli(k, 0.3, s),
    lambda k, s: jax.random.normal(k, s),
    lambda k, s: jax.random.randint(k, s, 0, 100),
    lambda k, s: jax.random.bits(k, s, jnp.uint8),
])
@pytest.mark.parametrize("blocks", [2, 8])
def test_blocks_are_slices_of_one_draw(draw, blocks):
    shape = (16, 3, 5)
    whole = draw(jax.random.fold_in(KEY, 3), shape)
    rows = shape[0] // blocks
    parts = [draw(jax.random.fold_in(sliced_rng.sliced_key(KEY, i, rows), 3), (rows, *shape[1:]))
             for i in range(blocks)]
    np.testing.assert_array_equal(np.concatenate(parts), whole)


def test_split_keys_stay_sliced_and_other_shapes_are_shared():
    sub = jax.random.split(sliced_rng.sliced_key(KEY, 1, 4), 2)[1]
    assert sliced_rng.is_sliced(sub)
    whole = jax.random.uniform(jax.random.split(KEY, 2)[1], (8, 2))
    np.testing.assert_array_equal(jax.random.uniform(sub, (4, 2)), whole[4:])
    # A draw whose leading dimension is not the block's rows is the same on every block.
    np.testing.assert_array_equal(jax.random.uniform(sub, (3,)),
                                  jax.random.uniform(jax.random.split(KEY, 2)[1], (3,)))


def test_offsets_past_two_to_the_32():
    for index, size in [(0, 5), (3, 2**31 + 7), (65535, 2**32 + 3), (2**20, 12345)]:
        hi, lo = sliced_rng._mul_64(jnp.uint32(index), size)
        assert (int(hi) << 32) + int(lo) == index * size


def test_unsliced_key_is_the_plain_key():
    back = sliced_rng.unsliced_key(sliced_rng.sliced_key(KEY, 5, 2))
    np.testing.assert_array_equal(jax.random.key_data(back), jax.random.key_data(KEY))
    assert str(jax.random.key_impl(back)) == "threefry2x32"


def test_per_shard_streams_fold_the_index():
    tree = sliced_rng.slice_keys({"k": KEY}, sliced_rng.Position(3, 4), 2, "per_shard")
    np.testing.assert_array_equal(jax.random.key_data(tree["k"]),
                                  jax.random.key_data(jax.random.fold_in(KEY, 3)))
    assert sliced_rng.slice_keys({"k": KEY}, sliced_rng.WHOLE, 8, "global")["k"] is KEY
