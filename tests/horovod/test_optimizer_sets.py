"""hvd.DistributedOptimizer(process_set=) on 8 simulated devices: inside @hvd.jit the set's
ranks train to the one-device run on the set's rows and every other rank to the one-device
run on its own rows (Horovod: no reduction outside the set), the compiled all-reduce has
the set's replica groups; eagerly a process's gradient counts once per rank of the set it
holds; pinned errors. (Eager across processes: tests/horovod/programs/collectives.py.)"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import parallax.horovod as hvd
from parallax.analysis import hlo

MEMBERS, STEPS, ROWS_PER_RANK = [0, 3, 6], 3, 2


@pytest.fixture(scope="module")
def members():
    ps = hvd.add_process_set(MEMBERS)
    yield ps
    hvd.remove_process_set(ps)


def loss_fn(params, batch):
    return jnp.mean((jnp.tanh(batch["x"] @ params["w"]) + params["b"] - batch["y"]) ** 2)


def init_params():
    return {"w": jnp.asarray(np.random.default_rng(1).standard_normal((4, 2)), jnp.float32),
            "b": jnp.zeros(2)}


def batches():
    rng = np.random.default_rng(0)
    return [{"x": rng.standard_normal((8 * ROWS_PER_RANK, 4)).astype(np.float32),
             "y": rng.standard_normal((8 * ROWS_PER_RANK, 2)).astype(np.float32)}
            for _ in range(STEPS)]


def rows_of(batch, ranks):
    take = np.concatenate([np.arange(r * ROWS_PER_RANK, (r + 1) * ROWS_PER_RANK) for r in ranks])
    return {k: v[take] for k, v in batch.items()}


def one_device(ranks):
    """Plain adam on one device, on the rows of ``ranks`` (their mean loss)."""
    tx, params = optax.adam(0.1), init_params()
    state = tx.init(params)
    for batch in batches():
        updates, state = tx.update(jax.grad(loss_fn)(params, rows_of(batch, ranks)), state,
                                   params)
        params = optax.apply_updates(params, updates)
    return params


@pytest.fixture(scope="module")
def trained(members):
    tx = hvd.DistributedOptimizer(optax.adam(0.1), process_set=members)

    @hvd.jit
    def step(own, batch):  # the ranks outside the set keep their own parameters: PerRank
        params, state = own.value
        updates, state = tx.update(jax.grad(loss_fn)(params, batch), state, params)
        return hvd.PerRank((optax.apply_updates(params, updates), state))

    params = init_params()
    own = hvd.PerRank((params, tx.init(params)))
    lowered = step.lower(own, batches()[0])
    for batch in batches():
        own = step(own, batch)
    return jax.tree.map(np.asarray, own.value[0]), lowered.compile()


def test_members_train_on_the_sets_rows_and_the_others_on_their_own(trained):
    params, _ = trained
    expected = {r: one_device(MEMBERS if r in MEMBERS else [r]) for r in (0, 1, 7)}
    for r in range(8):
        want = expected[0] if r in MEMBERS else expected.get(r) or one_device([r])
        for name in ("w", "b"):
            np.testing.assert_allclose(params[name][r], want[name], rtol=1e-5, atol=1e-6)


def test_the_compiled_all_reduce_has_the_sets_replica_groups(trained):
    _, compiled = trained
    reduces = [c for c in hlo.collectives(compiled) if c.kind == "all-reduce"]
    assert reduces, compiled.as_text()[:2000]
    assert all(set(c.groups) == {(0, 3, 6), (1,), (2,), (4,), (5,), (7,)} for c in reduces)
    assert sum(c.message_bytes for c in reduces) == (4 * 2 + 2) * 4  # the gradients, once


def test_eagerly_a_process_counts_once_per_rank_of_the_set_it_holds(members):
    """One process holds ranks 0 .. 7, three of them in the set: Average is its own
    gradient, Sum three times it."""
    params = init_params()
    grads = jax.grad(loss_fn)(params, batches()[0])
    for op, factor in ((hvd.Average, 1.0), (hvd.Sum, 3.0)):
        tx = hvd.DistributedOptimizer(optax.sgd(1.0), op=op, process_set=members)
        updates, _ = tx.update(grads, tx.init(params), params)
        for name in ("w", "b"):
            np.testing.assert_allclose(updates[name], -factor * grads[name], rtol=1e-6)


def test_bad_uses_of_process_set_are_refused(members):
    with pytest.raises(NotImplementedError, match=re.escape(
            "hvd.DistributedOptimizer: op=hvd.Adasum with a process_set is not supported "
            "(nor in Horovod); use hvd.Average or hvd.Sum.")):
        hvd.DistributedOptimizer(optax.sgd(1.0), op=hvd.Adasum, process_set=members)
    with pytest.raises(ValueError, match=re.escape(
            "hvd.DistributedOptimizer: algorithm='tree' sums over the whole Horovod axis by "
            "point-to-point exchanges; with a process_set pass algorithm='xla'")):
        hvd.DistributedOptimizer(optax.sgd(1.0), algorithm="tree", process_set=members)
    with pytest.raises(TypeError, match=re.escape(
            "hvd.DistributedOptimizer: process_set=[0, 3] is not an hvd.ProcessSet")):
        hvd.DistributedOptimizer(optax.sgd(1.0), process_set=[0, 3])
    with pytest.raises(ValueError, match=re.escape(
            "hvd.DistributedOptimizer: ProcessSet(process_set_id=None, ranks=[1, 2]) is not "
            "registered; pass it to hvd.add_process_set first")):
        hvd.DistributedOptimizer(optax.sgd(1.0), process_set=hvd.ProcessSet([1, 2]))
