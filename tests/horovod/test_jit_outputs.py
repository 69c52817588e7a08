"""@hvd.jit's results are replicated arrays: a result the ranks computed differently is
refused on the first call (issue: a step without DistributedOptimizer read as replicated),
hvd.PerRank keeps one value per rank, and check_outputs says when to check."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import parallax.horovod as hvd

ROWS = np.arange(32.0, dtype=np.float32).reshape(16, 2)


def grads(w, batch):
    return jax.grad(lambda w: jnp.mean((batch @ w) ** 2))(w)


def test_a_result_the_ranks_computed_differently_is_refused_on_the_first_call():
    @hvd.jit
    def step(w, batch):  # each rank applies its own gradient: N models, silently
        return {"w": w - 0.1 * grads(w, batch)}, hvd.allreduce(jnp.sum(batch))

    with pytest.raises(ValueError, match=re.escape(
            "hvd.jit: the step returned a different value on each rank for "
            "result[0]['w'] float32[2]; @hvd.jit returns one replicated array per result, so "
            "this would silently be one rank's value (in Horovod each rank keeps its own). "
            "Reduce it over the ranks (hvd.allreduce(x), or apply the gradients through "
            "hvd.DistributedOptimizer), or return it as hvd.PerRank(x) to keep one value per "
            "rank; check_outputs='never' skips this check.")):
        step(jnp.ones(2), ROWS)


def test_reduced_results_and_per_rank_ones_pass():
    tx = hvd.DistributedOptimizer(optax.sgd(0.1))

    @hvd.jit
    def step(w, opt_state, batch):
        g = grads(w, batch)
        updates, opt_state = tx.update(g, opt_state, w)
        return optax.apply_updates(w, updates), opt_state, hvd.PerRank(g)

    w, _, own = step(jnp.ones(2), tx.init(jnp.ones(2)), ROWS)
    per_rank = np.asarray(own.value)
    assert per_rank.shape == (jax.device_count(), 2)
    assert not np.allclose(per_rank[0], per_rank[1])  # each rank's own gradient, kept
    np.testing.assert_allclose(w, 1 - 0.1 * per_rank.mean(0), rtol=1e-6)


def test_adasum_results_are_the_same_on_every_rank():
    tx = hvd.DistributedOptimizer(optax.sgd(0.01), op=hvd.Adasum)

    @hvd.jit
    def step(w, opt_state, batch):
        updates, opt_state = tx.update(grads(w, batch), opt_state, w)
        return optax.apply_updates(w, updates), opt_state

    w, state = jnp.ones(2), tx.init(jnp.ones(2))
    for _ in range(2):
        w, state = step(w, state, ROWS)


def test_check_outputs_never_and_always():
    def unreduced(w, batch):
        return w - 0.1 * grads(w, batch)

    w = hvd.jit(check_outputs="never")(unreduced)(jnp.ones(2), ROWS)
    assert w.shape == (2,)  # one rank's value: what the user asked for by opting out
    always = hvd.jit(check_outputs="always")(unreduced)
    for _ in range(2):  # "always" checks again where "first" would not
        with pytest.raises(ValueError, match="different value on each rank"):
            always(jnp.ones(2), ROWS)
    with pytest.raises(ValueError, match=re.escape(
            "hvd.jit: check_outputs='sometimes' is not one of ('first', 'always', 'never').")):
        hvd.jit(check_outputs="sometimes")
