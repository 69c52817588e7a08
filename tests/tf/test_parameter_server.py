"""ParameterServerStrategy: partitioners, placement, training equal to one device, sparse
embedding tables whose rows only are pulled."""

import json

import jax
import numpy as np
import optax
import pytest

import parallax as px
from parallax.tf.parameter_server.partitioners import shard_rows
from tf import ps_testing


# -- partitioners (no Ray) ----------------------------------------------------------------

@pytest.mark.parametrize("partitioner, shape, expected", [
    (px.tf.FixedShardsPartitioner(2), (6, 1), [2, 1]),
    (px.tf.FixedShardsPartitioner(8), (3,), [3]),
    (px.tf.MinSizePartitioner(min_shard_bytes=4, max_shards=2), (6, 1), [2, 1]),
    (px.tf.MinSizePartitioner(min_shard_bytes=4, max_shards=10), (6, 1), [6, 1]),
    (px.tf.MinSizePartitioner(), (1024, 1024), [1, 1]),  # default max_shards=1
    (px.tf.MinSizePartitioner(max_shards=8), (1024, 1024), [8, 1]),  # 4 MiB / 256 KiB = 16
    (px.tf.MaxSizePartitioner(max_shard_bytes=4), (6, 1), [6, 1]),
    (px.tf.MaxSizePartitioner(max_shard_bytes=4, max_shards=2), (6, 1), [2, 1]),
    (px.tf.MaxSizePartitioner(max_shard_bytes=1024), (6, 1), [1, 1]),
    (px.tf.MaxSizePartitioner(max_shard_bytes=100), (10, 10), [5, 1]),  # 2 rows of 40 B each
])
def test_partitioners_match_tensorflow(partitioner, shape, expected):
    assert partitioner(shape, np.float32) == expected


def test_uneven_shards_put_the_extra_rows_first():
    assert shard_rows(10, 4) == [3, 3, 2, 2]
    assert sum(shard_rows(1001, 7)) == 1001


def test_partitioner_errors_are_named():
    with pytest.raises(ValueError, match="FixedShardsPartitioner: num_shards must be positive"):
        px.tf.FixedShardsPartitioner(0)
    with pytest.raises(TypeError, match="max_shard_bytes must be an int"):
        px.tf.MaxSizePartitioner(1.5)
    with pytest.raises(ValueError, match=r"scalar variable cannot be partitioned \(shape \(\)\)"):
        px.tf.MinSizePartitioner()((), np.float32)


# -- on the servers --------------------------------------------------------------------------



# The chief's TF_CONFIG: one worker and two ps tasks (one worker actor, two servers).
TF_CONFIG = {"cluster": {"chief": ["h0:2222"], "worker": ["h1:2222"],
                         "ps": ["h2:2222", "h3:2222"]}, "task": {"type": "chief", "index": 0}}


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    resolver = px.tf.TFConfigClusterResolver(environ={"TF_CONFIG": json.dumps(TF_CONFIG)})
    strategy = px.tf.ParameterServerStrategy(
        resolver, variable_partitioner=px.tf.FixedShardsPartitioner(2))
    coordinator = px.tf.ClusterCoordinator(strategy)
    yield strategy, coordinator
    coordinator.shutdown()
    strategy.shutdown()


@pytest.mark.xdist_group("ray")
@pytest.mark.slow
def test_variables_are_sharded_round_robin_over_the_servers(cluster):
    strategy, _ = cluster
    model = strategy.distribute_model(ps_testing.mlp(), ps_testing.TX)
    kernel = model.variables["['layers'][0]['kernel']"]
    assert kernel.shape == (4, 16) and [s.rows for s in kernel.shards] == [2, 2]
    servers = [s.server for v in model.variables.values() for s in v.shards]
    assert sorted(set(servers)) == [0, 1] and abs(servers.count(0) - servers.count(1)) <= 1
    params = ps_testing.mlp()
    np.testing.assert_array_equal(kernel.read(), np.asarray(params.layers[0].kernel[...]))


@pytest.mark.xdist_group("ray")
@pytest.mark.slow
def test_one_worker_equals_one_device_run(cluster):
    strategy, coordinator = cluster
    batches = ps_testing.mlp_batches(5)
    model = strategy.distribute_model(ps_testing.mlp(), ps_testing.TX)
    step = model.train_step(px.models.mse_loss)
    dataset = coordinator.create_per_worker_dataset(lambda: iter(batches))
    iterator = iter(dataset)
    losses = [coordinator.schedule(lambda it: step(next(it)), args=(iterator,)).fetch()
              for _ in batches]  # fetched one by one: each step sees the previous push
    ref_losses, ref_params, ref_opt = ps_testing.reference_run(
        ps_testing.mlp(), ps_testing.TX, px.models.mse_loss, batches)
    assert px.testing.relative_difference(np.array(losses), np.array(ref_losses)) <= 1e-6
    assert px.testing.relative_difference(coordinator.fetch(model), ref_params) <= 1e-6
    # the optimizer's state is on the servers too: Adagrad's accumulators, per parameter
    slots = {name: v.read() for name, v in model.optimizer_variables(0).items()}
    ref_slots = [np.asarray(x) for x in jax.tree.leaves(ref_opt[0].sum_of_squares)]
    assert px.testing.relative_difference(list(slots.values()), ref_slots) <= 1e-6


@pytest.mark.xdist_group("ray")
@pytest.mark.slow
def test_sparse_embedding_pulls_only_touched_rows_and_equals_one_device(cluster):
    strategy, coordinator = cluster
    rng = np.random.default_rng(3)
    users = strategy.create_variable(
        lambda shape, dtype: rng.standard_normal(shape).astype(dtype) * 0.1,
        shape=(ps_testing.USERS, ps_testing.DIM), name="users")
    items = strategy.create_variable(
        rng.standard_normal((ps_testing.ITEMS, ps_testing.DIM)).astype(np.float32) * 0.1,
        name="items")
    initial_users, initial_items = users.read(), items.read()
    tower = strategy.distribute_model(ps_testing.tower(), ps_testing.TX)
    batches = ps_testing.rating_batches(5)
    step = ps_testing.make_sparse_step(tower, users, items)
    dataset = iter(coordinator.create_per_worker_dataset(lambda: iter(batches)))
    results = [coordinator.schedule(step, args=(dataset,)).fetch() for _ in batches]

    # measured: per step the worker pulled at most 2 x 32 rows of the 1500-row tables
    table_bytes = users.nbytes + items.nbytes
    pulled = [r["table_bytes_pulled"] for r in results]
    assert max(pulled) <= 64 * ps_testing.DIM * 4 < table_bytes / 20

    ref_losses, (ref_tower, ref_users, ref_items) = ps_testing.reference_rating_run(
        ps_testing.tower(), initial_users, initial_items, ps_testing.TX, batches)
    losses = [float(r["loss"]) for r in results]
    assert px.testing.relative_difference(np.array(losses), np.array(ref_losses)) <= 1e-6
    assert px.testing.relative_difference([users.read(), items.read()],
                                          [ref_users, ref_items]) <= 1e-6
    assert px.testing.relative_difference(tower.pull_params(), ref_tower) <= 1e-6
    touched = np.unique(np.concatenate([b["user"] for b in batches]))
    untouched = np.setdiff1d(np.arange(ps_testing.USERS), touched)
    np.testing.assert_array_equal(users.read()[untouched], initial_users[untouched])


@pytest.mark.xdist_group("ray")
@pytest.mark.slow
def test_strategy_errors_are_named(cluster):
    strategy, _ = cluster
    with pytest.raises(ValueError, match="already run another optimizer"):
        strategy.set_optimizer(optax.sgd(0.1))
    with pytest.raises(ValueError, match="a variable named 'users' exists already"):
        strategy.create_variable(np.zeros((2, 2)), name="users")
    with pytest.raises(TypeError, match="cluster_resolver must be a px.tf.RayClusterResolver"):
        px.tf.ParameterServerStrategy({"worker": 2})
    with pytest.raises(TypeError, match="variable_partitioner must be callable"):
        px.tf.ParameterServerStrategy(variable_partitioner=2)
    variable = strategy.create_variable(np.zeros((4, 2)), name="small")
    with pytest.raises(ValueError, match=r"id 9 is outside 'small''s 4 rows \[0, 4\)"):
        variable.lookup(np.array([1, 9]))
    with pytest.raises(ValueError, match=r"has shape \(4, 2\), got a gradient of shape \(2,\)"):
        variable.apply_gradient(np.zeros(2))


@pytest.mark.xdist_group("ray")
@pytest.mark.slow
def test_tf_config_ps_tasks_are_the_servers_and_scope_places_variables(cluster):
    """One server per ps task of TF_CONFIG; variables created in scope() are partitioned,
    placed round-robin, and train as the one-process optax run does (3 steps)."""
    strategy, _ = cluster
    assert strategy.store.num_servers == 2 and strategy.num_workers == 1
    strategy.set_optimizer(ps_testing.TX)  # the strategy's one optimizer (no-op if set)
    rng = np.random.default_rng(0)
    initial = {"w": rng.standard_normal((4, 3)).astype(np.float32),
               "b": rng.standard_normal((3,)).astype(np.float32)}
    with strategy.scope():
        assert px.tf.get_replica_context() is None  # cross-replica, as in TensorFlow
        variables = {name: px.tf.Variable(value, name=f"scoped/{name}")
                     for name, value in initial.items()}
    servers = [s.server for v in variables.values() for s in v.shards]
    assert [s.rows for v in variables.values() for s in v.shards] == [2, 2, 2, 1]
    assert servers in ([0, 1, 0, 1], [1, 0, 1, 0])  # round-robin, continuing across variables
    params, state = dict(initial), ps_testing.TX.init(initial)
    for _ in range(3):
        grads = {name: rng.standard_normal(v.shape).astype(np.float32)
                 for name, v in initial.items()}
        for name, variable in variables.items():
            variable.apply_gradient(grads[name])
        updates, state = ps_testing.TX.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    assert px.testing.relative_difference(
        {name: v.read() for name, v in variables.items()}, params) <= 1e-6
