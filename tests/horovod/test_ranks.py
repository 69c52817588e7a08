"""One rank is one device everywhere in parallax.horovod (Horovod's one rank per accelerator):
``hvd.size()`` counts what ``@hvd.jit``'s collectives and ``DistributedOptimizer`` reduce
over, here 8 simulated devices in one process; so Horovod's ``lr * hvd.size()`` and
``take(N // hvd.size())`` keep their meaning. (Several processes, 2 x 2 devices:
tests/horovod/programs/collectives.py through tests/distributed/test_multiprocess.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import parallax.horovod as hvd


def test_size_counts_the_ranks_the_collectives_reduce_over():
    assert jax.device_count() == 8 and jax.process_count() == 1
    assert (hvd.size(), hvd.rank(), hvd.local_size(), hvd.local_rank()) == (8, 0, 8, 0)

    @hvd.jit
    def step(batch):  # per rank: the ranks' numbers, and a Sum of ones over the ranks
        ones = hvd.allreduce(jnp.ones(()), op=hvd.Sum)
        return (hvd.allgather(jnp.stack([hvd.rank(), hvd.local_rank()])[None]), ones,
                hvd.size() + 0 * ones, hvd.local_size() + 0 * ones)

    ranks, ones, size, local_size = step(np.zeros((8, 1), np.float32))
    assert np.asarray(ranks).tolist() == [[r, r] for r in range(8)]
    assert float(ones) == hvd.size() == float(size) == float(local_size)
    # eagerly, this process's value stands for each of its 8 ranks, as a replicated
    # argument of @hvd.jit does
    assert float(hvd.allreduce(np.float32(1), op=hvd.Sum)) == hvd.size()
    assert float(hvd.allreduce(np.float32(3))) == 3.0
    np.testing.assert_array_equal(hvd.allgather(np.arange(2)), np.tile(np.arange(2), 8))


def test_horovods_scaling_recipe_means_what_it_does_in_horovod():
    """lr * hvd.size() with per-rank batches of N // hvd.size() rows: each rank's gradient
    is its rows' mean, DistributedOptimizer averages over the size() ranks; so one step is
    sgd(lr * size) on the full batch's mean gradient, as with Horovod's 8 processes."""
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((32, 3), np.float32), rng.standard_normal((32, 1), np.float32)
    per_rank = len(x) // hvd.size()
    assert per_rank == 4
    loss = lambda w, xb, yb: jnp.mean((xb @ w - yb) ** 2)  # noqa: E731
    tx = hvd.DistributedOptimizer(optax.sgd(0.01 * hvd.size()))

    @hvd.jit
    def step(w, state, batch):
        assert batch["x"].shape[0] == per_rank  # each rank gets N // hvd.size() rows
        updates, state = tx.update(jax.grad(loss)(w, batch["x"], batch["y"]), state, w)
        return optax.apply_updates(w, updates), state

    w = jnp.zeros((3, 1))
    got, _ = step(w, tx.init(w), {"x": x, "y": y})
    want = w - 0.01 * 8 * jax.grad(loss)(w, x, y)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_eager_alltoall_with_several_ranks_per_process_is_refused():
    with pytest.raises(ValueError, match=r"hvd\.alltoall: this process holds ranks 0 \.\. 7 "
                                         r"\(8 devices\), and each of them would receive "
                                         r"different parts"):
        hvd.alltoall(np.arange(8))
