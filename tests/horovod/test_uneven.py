"""Uneven first dimensions inside @hvd.jit: allgather(valid_rows=) and alltoall(splits=)
return padded results with the true sizes, equal to the unpadded exchange computed in
numpy; eagerly the valid rows are gathered directly."""

import re

import jax.numpy as jnp
import numpy as np
import pytest

import parallax.horovod as hvd

N, ROWS = 8, 4
X = np.arange(N * ROWS, dtype=np.float32).reshape(N, ROWS, 1) + 1.0  # rank r's buffer


def splits_of(r):  # rank r sends (r + j) % 3 rows to rank j, at most ROWS in all
    s = np.array([(r + j) % 3 for j in range(N)])
    while s.sum() > ROWS:
        s[np.argmax(s)] -= 1
    return s


SPLITS = np.stack([splits_of(r) for r in range(N)]).astype(np.int32)


@pytest.fixture(scope="module")
def results():
    @hvd.jit(batch_argnums=(0, 1), check_outputs="never")
    def step(x, splits):
        x, splits = x[0], splits[0]
        gathered, counts = hvd.allgather(x, valid_rows=hvd.rank() % 3 + 1)
        received, received_splits = hvd.alltoall(x, splits=splits)
        return hvd.PerRank((gathered, counts, received, received_splits))

    return [np.asarray(v) for v in step(X, SPLITS).value]


def test_allgather_valid_rows_pads_and_returns_the_counts(results):
    gathered, counts = results[0], results[1]
    want = [min(r % 3 + 1, ROWS) for r in range(N)]
    for r in range(N):
        assert counts[r].tolist() == want
        blocks = gathered[r].reshape(N, ROWS, 1)
        for s in range(N):
            np.testing.assert_array_equal(blocks[s, :want[s]], X[s, :want[s]])
            assert not blocks[s, want[s]:].any()


def test_alltoall_splits_equals_the_unpadded_exchange(results):
    received, received_splits = results[2], results[3]
    starts = np.cumsum(SPLITS, axis=1) - SPLITS
    for r in range(N):
        assert received_splits[r].tolist() == SPLITS[:, r].tolist()
        blocks = received[r].reshape(N, ROWS, 1)
        for s in range(N):
            sent = X[s, starts[s, r]:starts[s, r] + SPLITS[s, r]]
            np.testing.assert_array_equal(blocks[s, :len(sent)], sent)
            assert not blocks[s, len(sent):].any()


def test_eager_valid_rows_and_bad_splits():
    out, counts = hvd.allgather(np.arange(6.0).reshape(3, 2), valid_rows=2)
    assert out.shape == (2 * N, 2) and counts.tolist() == [2] * N

    @hvd.jit(check_outputs="never")
    def bad(x):
        return hvd.alltoall(x[0], splits=jnp.ones(3, jnp.int32))

    with pytest.raises(ValueError, match=re.escape(
            "hvd.alltoall: splits must hold one count per rank (shape (8,)), got shape (3,)")):
        bad(np.ones((8, 4), np.float32))
