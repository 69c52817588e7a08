"""hvd.DistributedOptimizer on 8 simulated devices (the ranks of @hvd.jit): the one-device
numbers, compression, predivision, DDP's no_sync (k micro-steps = one big batch, one sync),
fused buckets in reverse order, point-to-point bucket sums, inside px.train_step, and pinned
errors."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import parallax as px
import parallax.horovod as hvd
from parallax.analysis import hlo

STEPS, ROWS = 3, 32


def init_params():
    keys = jax.random.split(jax.random.key(0), 2)
    return {"w1": jax.random.normal(keys[0], (8, 32)) / 3, "b1": jnp.zeros(32),
            "w2": jax.random.normal(keys[1], (32, 4)) / 6}


def loss_fn(params, batch):
    hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2)


def data(steps=STEPS, rows=ROWS):
    rng = np.random.default_rng(0)
    return [{"x": rng.standard_normal((rows, 8), np.float32),
             "y": rng.standard_normal((rows, 4), np.float32)} for _ in range(steps)]


def one_device(tx, batches):
    """The plain program: full batches, one device."""
    params, losses = init_params(), []
    state = tx.init(params)

    @jax.jit
    def step(params, state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    for batch in batches:
        params, state, loss = step(params, state, batch)
        losses.append(float(loss))
    return losses, params


def horovod(tx, batches):
    """The Horovod-style step: per rank, the optimizer averages over the 8 ranks."""
    params, losses = init_params(), []
    state = tx.init(params)

    @hvd.jit
    def step(params, state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, hvd.allreduce(loss)

    for batch in batches:
        params, state, loss = step(params, state, batch)
        losses.append(float(loss))
    return losses, params, step


def close(a, b, rtol):
    assert px.testing.relative_difference(a, b) <= rtol, px.testing.relative_difference(a, b)


@pytest.mark.parametrize("op, predivide", [(hvd.Average, 1.0), (hvd.Average, 4.0)])
def test_trains_to_the_one_device_numbers(op, predivide):
    ref_losses, ref_params = one_device(optax.adam(1e-2), data())
    tx = hvd.DistributedOptimizer(optax.adam(1e-2), op=op, gradient_predivide_factor=predivide)
    losses, params, _ = horovod(tx, data())
    close(np.array(losses), np.array(ref_losses), 1e-6)
    close(params, ref_params, 1e-5)


def test_sum_is_size_times_average():
    ref_losses, ref_params = one_device(optax.sgd(0.08), data())
    losses, params, _ = horovod(hvd.DistributedOptimizer(optax.sgd(0.01), op=hvd.Sum), data())
    close(np.array(losses), np.array(ref_losses), 1e-6)
    close(params, ref_params, 1e-5)


@pytest.mark.parametrize("compression, bound", [(hvd.Compression.fp16, 2e-3),
                                                (hvd.Compression.bf16, 2e-2)])
def test_compression_stays_within_its_rounding(compression, bound):
    ref_losses, ref_params = one_device(optax.sgd(0.1), data())
    tx = hvd.DistributedOptimizer(optax.sgd(0.1), compression=compression)
    losses, params, _ = horovod(tx, data())
    assert 0 < px.testing.relative_difference(params, ref_params) <= bound


def test_no_sync_k_micro_steps_are_one_big_batch_with_one_sync():
    k = 2
    big = data(steps=2, rows=ROWS * k)
    ref_losses, ref_params = one_device(optax.sgd(0.1, momentum=0.9), big)
    micro = [{key: v[i * ROWS:(i + 1) * ROWS] for key, v in b.items()} for b in big
             for i in range(k)]
    tx = hvd.DistributedOptimizer(optax.sgd(0.1, momentum=0.9), backward_passes_per_step=k,
                                  average_aggregated_gradients=True)
    params, state = init_params(), tx.init(init_params())
    _, _, step = horovod(tx, [])
    for i, batch in enumerate(micro):
        before = params
        params, state, _ = step(params, state, batch)
        if i % k == 0:  # accumulated locally, nothing applied
            close(params, before, 0.0)
    close(params, ref_params, 1e-5)
    # one synchronisation per k calls: every gradient all-reduce sits in the branch taken on
    # the k-th call
    found = [c for c in hlo.collectives(step.lower(params, state, micro[0]).compile(), hvd.mesh())
             if c.kind == "all-reduce" and c.message_bytes > 4]
    assert found and all(c.conditional for c in found)


def test_backward_passes_sum_as_horovod_and_no_sync_do():
    """Horovod sums the k local gradients and does not divide by k unless asked:
    horovod/torch/optimizer.py accumulates in ``p.grad`` and all-reduces that sum (DDP's
    ``no_sync`` likewise); horovod/tensorflow/gradient_aggregation.py and
    gradient_aggregation_eager.py divide by ``backward_passes_per_step`` only with
    ``average_aggregated_gradients=True`` (default False). Two calls of a gradient of ones
    under sgd(0.1): -0.2 (the sum), -0.1 with averaging."""
    params = {"w": jnp.ones(2)}
    for average, want in ((False, -0.2), (True, -0.1)):
        tx = hvd.DistributedOptimizer(optax.sgd(0.1), backward_passes_per_step=2,
                                      average_aggregated_gradients=average)
        state = tx.init(params)
        _, state = tx.update({"w": jnp.ones(2)}, state, params)
        updates, state = tx.update({"w": jnp.ones(2)}, state, params)
        np.testing.assert_allclose(updates["w"], [want, want], rtol=1e-6)
    # inside @hvd.jit, k micro-steps of the summed gradient = one step of k times the
    # big batch's mean gradient (sgd: k times the learning rate)
    k = 2
    big = data(steps=2, rows=ROWS * k)
    _, ref_params = one_device(optax.sgd(0.1 * k), big)
    micro = [{key: v[i * ROWS:(i + 1) * ROWS] for key, v in b.items()} for b in big
             for i in range(k)]
    tx = hvd.DistributedOptimizer(optax.sgd(0.1), backward_passes_per_step=k)
    params, state = init_params(), tx.init(init_params())
    _, _, step = horovod(tx, [])
    for batch in micro:
        params, state, _ = step(params, state, batch)
    close(params, ref_params, 1e-5)


def test_fused_buckets_in_reverse_order():
    params = init_params()
    fusion = 512
    tx = hvd.DistributedOptimizer(optax.sgd(0.1), fusion_bytes=fusion)
    _, _, step = horovod(tx, [])
    compiled = step.lower(params, tx.init(params), data(1)[0]).compile(
        compiler_options={"xla_disable_hlo_passes": "cpu-all-reduce-combiner"})
    found = [c for c in hlo.collectives(compiled, hvd.mesh())
             if c.kind == "all-reduce" and c.message_bytes > 4]
    grad_bytes = 4 * sum(x.size for x in jax.tree.leaves(params))
    assert len(found) == math.ceil(grad_bytes / fusion)
    assert sum(c.message_bytes for c in found) == grad_bytes
    plan = px.comm.pack_buckets(params, fusion)  # what the optimizer packs: last leaf first
    assert plan[0].pieces[0][0] == len(jax.tree.leaves(params)) - 1


@pytest.mark.parametrize("algorithm", ["tree", "ring", "auto"])
def test_point_to_point_sums_train_to_the_one_device_numbers(algorithm):
    ref_losses, ref_params = one_device(optax.adam(1e-2), data())
    tx = hvd.DistributedOptimizer(optax.adam(1e-2), algorithm=algorithm, fusion_bytes=1024)
    losses, params, step = horovod(tx, data())
    close(np.array(losses), np.array(ref_losses), 1e-6)
    close(params, ref_params, 1e-5)
    # the gradients travel as collective-permutes; the only all-reduce left is the loss's
    params = init_params()
    found = hlo.collectives(step.lower(params, tx.init(params), data(1)[0]).compile(),
                            hvd.mesh())
    assert [c for c in found if c.kind == "collective-permute"]
    assert all(c.message_bytes <= 4 for c in found if c.kind == "all-reduce")


@pytest.mark.slow
def test_inside_px_train_step_the_strategy_has_already_averaged():
    k, make = 2, lambda tx: (lambda: px.TrainState.create(
        px.models.MLP(8, [32], 4, rngs=__import__("flax").nnx.Rngs(0)), tx))
    big = [{"x": b["x"], "y": b["y"]} for b in data(steps=2, rows=ROWS * k)]
    ref = px.testing.train(make(optax.sgd(0.1)), px.models.mse_loss, big)
    micro = [{key: v[i * ROWS:(i + 1) * ROWS] for key, v in b.items()} for b in big
             for i in range(k)]
    wrapped = hvd.DistributedOptimizer(optax.sgd(0.1), backward_passes_per_step=k,
                                       average_aggregated_gradients=True)
    run = px.testing.train(make(wrapped), px.models.mse_loss, micro,
                           mesh=px.make_mesh(data=8), strategy=px.DataParallel("data"))
    close(run.final_params, ref.final_params, 1e-5)


def test_errors():
    with pytest.raises(TypeError, match=r"hvd\.DistributedOptimizer: tx must be an "
                                        r"optax\.GradientTransformation"):
        hvd.DistributedOptimizer("adam")
    with pytest.raises(ValueError, match=r"backward_passes_per_step=0 must be an int >= 1"):
        hvd.DistributedOptimizer(optax.sgd(0.1), backward_passes_per_step=0)
    with pytest.raises(ValueError, match=r"gradient_predivide_factor=2\.0 must be > 0, and "
                                         r"other than 1 only with op=hvd\.Average"):
        hvd.DistributedOptimizer(optax.sgd(0.1), op=hvd.Sum, gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match=r"op=ReduceOp\.Max reduces gradients with "
                                         r"hvd\.Average, hvd\.Sum or hvd\.Adasum only"):
        hvd.DistributedOptimizer(optax.sgd(0.1), op=hvd.Max)
    with pytest.raises(ValueError, match=re.escape(
            "hvd.DistributedOptimizer: algorithm='hierarchical' must be one of 'xla', 'tree', "
            "'ring', 'auto': XLA's all-reduce, or a point-to-point algorithm of parallax.comm.")):
        hvd.DistributedOptimizer(optax.sgd(0.1), algorithm="hierarchical")
    with pytest.raises(ValueError, match=re.escape(
            "hvd.DistributedOptimizer: algorithm='tree' sums buckets; op=hvd.Adasum has its own "
            "pairwise rounds. Pass algorithm='xla' (the default) with Adasum.")):
        hvd.DistributedOptimizer(optax.sgd(0.1), op=hvd.Adasum, algorithm="tree")
    tx = hvd.DistributedOptimizer(optax.sgd(0.1))
    params = init_params()
    with pytest.raises(ValueError, match=re.escape(
            "hvd.DistributedOptimizer: update was traced where the Horovod axis 'data' is not "
            "bound (inside a plain jax.jit each process runs alone). Run the step with "
            "@hvd.jit")):
        jax.jit(lambda g, s: tx.update(g, s, params))(params, tx.init(params))
    with pytest.raises(ValueError, match=re.escape(
            "hvd.allreduce: called on traced values where the Horovod axis 'data' is not bound")):
        jax.jit(hvd.allreduce)(jnp.ones(2))


@pytest.mark.parametrize("grouping", [dict(num_groups=2),
                                      dict(groups=[["['b1']", "['w2']"]])])
def test_explicit_groups_are_one_all_reduce_each_and_train_the_same(grouping):
    """Horovod's num_groups / groups: the compiled step holds one all-reduce per group (the
    combiner off, as above), of the group's bytes, and trains to the one-device numbers."""
    batches = data(2)
    tx = hvd.DistributedOptimizer(optax.sgd(0.1), **grouping)
    losses, params, step = horovod(tx, batches)
    want_losses, want_params = one_device(optax.sgd(0.1), batches)
    close(losses, want_losses, 1e-5)
    close(params, want_params, 1e-5)
    init = init_params()
    compiled = step.lower(init, tx.init(init), batches[0]).compile(
        compiler_options={"xla_disable_hlo_passes": "cpu-all-reduce-combiner"})
    found = sorted(c.message_bytes for c in hlo.collectives(compiled, hvd.mesh())
                   if c.kind == "all-reduce" and c.message_bytes > 4)
    sizes = {"b1": 32 * 4, "w1": 8 * 32 * 4, "w2": 32 * 4 * 4}  # leaves: b1, w1, w2
    want = ([sizes["b1"], sizes["w1"] + sizes["w2"]] if "num_groups" in grouping
            else [sizes["w1"], sizes["b1"] + sizes["w2"]])
    assert found == sorted(want)


def test_bad_groups_are_refused():
    with pytest.raises(ValueError, match=re.escape(
            "hvd.DistributedOptimizer: groups names \"['w3']\", which is no parameter path; "
            "the paths are [\"['b1']\", \"['w1']\", \"['w2']\"].")):
        tx = hvd.DistributedOptimizer(optax.sgd(0.1), groups=[["['w3']"]])
        horovod(tx, data(1))
    with pytest.raises(ValueError, match=re.escape(
            "hvd.DistributedOptimizer: pass num_groups= or groups=, not both.")):
        hvd.DistributedOptimizer(optax.sgd(0.1), num_groups=2, groups=[["['w1']"]])
