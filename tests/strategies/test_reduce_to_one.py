"""px.ReduceToOne: PyTorch DataParallel's reduce-to-root + broadcast, as a gradient sync.

It must train to the one-device numbers like any sync, issue the messages its docstring
names (whole buffers into the root, chunks out of it, one all-gather) and put on the root
the traffic that makes DataParallel slower than DDP's ring all-reduce.
"""

import fixtures as fx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import parallax as px
from parallax.analysis import hlo
from parallax.strategies.reduce_to_one import ReduceToOne, reduce_to_one_all_reduce


def received_bytes(found, n):
    """Bytes each device receives in one call: permutes by pair; all-gathers and ring
    all-reduces by their per-device share ((g-1)/g and 2(g-1)/g of the message)."""
    per = np.zeros(n)
    for c in found:
        if c.kind == "collective-permute":
            for _, dst in c.pairs:
                per[dst] += c.message_bytes * c.count
        else:
            g = c.group_size
            share = {"all-gather": 1, "all-reduce": 2}[c.kind] * (g - 1) / g
            per += share * c.message_bytes * c.count
    return per


@pytest.mark.slow
def test_reduce_to_one_trains_like_one_device():
    make, loss, data, tx, ref = fx.reference("mlp")
    run = px.testing.train(make, loss, data, mesh=px.make_mesh(data=8),
                           strategy=px.DataParallel("data", sync=ReduceToOne(root=3)))
    px.testing.assert_equivalent(run, ref, rtol=1e-5)


def _step_collectives(sync):
    mesh = px.make_mesh(data=8)
    strategy = px.DataParallel("data", sync=sync)
    state = px.init(fx.mlp_state, mesh, strategy)
    step = fx.mlp_step(mesh, strategy)
    compiled = step.lower(state, fx.mlp_batches(1)[0]).compile()
    grad_bytes = 4 * sum(x.size for x in jax.tree.leaves(state.params))
    return hlo.collectives(compiled, mesh), grad_bytes


@pytest.mark.slow
def test_root_carries_the_traffic():
    n, root = 8, 2
    found, size = _step_collectives(ReduceToOne(root=root))
    permutes = [c for c in found if c.kind == "collective-permute"]
    into = [c for c in permutes if c.pairs[0][1] == root]
    assert sorted(src for c in into for src, _ in c.pairs) == [r for r in range(n) if r != root]
    assert sum(c.message_bytes for c in into) == (n - 1) * size  # every gradient, once
    assert all(c.pairs[0][0] == root for c in permutes if c not in into)
    received = received_bytes(found, n)
    ddp = received_bytes(_step_collectives(None)[0], n)
    # DDP: every device 2(n-1)/n S (+ the scalar loss); DataParallel: the root (n-1) S more
    assert received[root] >= (n - 1) * size > 3.9 * ddp.max()
    assert np.allclose(ddp, ddp[0]) and ddp[0] == pytest.approx(2 * (n - 1) / n * size, rel=1e-3)
    others = np.delete(received, root)
    assert np.all(others <= 1.01 * size + 64)  # a chunk from the root, then the all-gather


def test_algorithm_equals_the_plain_all_reduce():
    bucket_bytes = 24  # leaves split across buffers of 6 floats / 12 bf16
    mesh = px.make_mesh(data=8)
    rng = np.random.default_rng(0)
    tree = {"odd": rng.standard_normal((8, 13)).astype(np.float32),
            "bf16": rng.standard_normal((8, 3, 5)).astype(jnp.bfloat16)}

    def both(t):
        mine = reduce_to_one_all_reduce(t, "data", root=5, bucket_bytes=bucket_bytes)
        mean = reduce_to_one_all_reduce(t["odd"], "data", root=0, op="mean")
        return mine, mean, jax.tree.map(lambda v: jax.lax.psum(v, "data"), t)

    run = jax.jit(jax.shard_map(both, mesh=mesh, in_specs=jax.P("data"), out_specs=jax.P()))
    mine, mean, plain = run(tree)
    np.testing.assert_allclose(mine["odd"], plain["odd"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(mean, plain["odd"] / 8, rtol=1e-6, atol=1e-6)
    assert mine["bf16"].dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(mine["bf16"], np.float32),
                               np.asarray(plain["bf16"], np.float32), atol=8 * 2.0**-8 * 4)


def test_errors():
    with pytest.raises(ValueError, match=r"px.ReduceToOne: root=-1 must be an int >= 0"):
        ReduceToOne(root=-1)
    with pytest.raises(ValueError, match=r"px.ReduceToOne: bucket_bytes=-5 must be an int >= 0"):
        ReduceToOne(bucket_bytes=-5)
    with pytest.raises(ValueError, match=r"px.ReduceToOne: root=8 is not a rank on the batch "
                                         r"axes \('data',\) of size 8; pick a root in \[0, 8\)"):
        _step_collectives(ReduceToOne(root=8))
    assert ReduceToOne(1) == ReduceToOne(root=1)  # values: equal settings compose
