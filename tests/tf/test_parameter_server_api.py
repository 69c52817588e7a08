"""The parameter-server API a TensorFlow script uses, with TensorFlow's answers: ``run`` and
``reduce`` inside a scheduled function, ``num_replicas_in_sync`` and ``extended``, variables
read as values, ``assign_sub`` on a variable or a shard, an optimizer given after the
variables (or none: a pushed gradient is refused, naming why), and datasets as
``create_per_worker_dataset`` takes them. The values asserted are TensorFlow 2.21's
(``parameter_server_strategy_v2.py``, ``distribute_lib.py``, ``sharded_variable.py``; the
devices as ``tests/tf/test_parameter_server_port.py`` reads them from TensorFlow itself)."""

import numpy as np
import optax
import pytest

import parallax as px
from tf import ps_testing

pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.slow]


@pytest.fixture(scope="module")
def job(ray_cluster):
    strategy = px.tf.ParameterServerStrategy(
        px.tf.RayClusterResolver(num_workers=1, num_ps=2),
        variable_partitioner=px.tf.FixedShardsPartitioner(2))
    coordinator = px.tf.ClusterCoordinator(strategy)
    yield strategy, coordinator
    coordinator.shutdown()
    strategy.shutdown()


def test_a_scheduled_function_runs_one_replica_and_reduces_as_tensorflow(job):
    strategy, coordinator = job
    for facts in (coordinator.schedule(ps_testing.replica_facts, args=(strategy,)).fetch(),
                  ps_testing.replica_facts(strategy)):  # on a worker, and on the coordinator
        assert facts["replicas"] == 1
        assert facts["worker_devices"] == ("/device:CPU:0",)
        assert facts["parameter_devices"] == ("/job:chief/replica:0/task:0/device:CPU:0",)
        run = facts["run"]
        assert (run["id"], run["replicas"]) == (0, 1)
        np.testing.assert_array_equal(run["all_reduce"], np.arange(4.0))  # one replica
        assert float(run["merged"]) == 1.5
        assert run["reduce_refused"].startswith(
            "px.tf.ParameterServerStrategy (on a worker).reduce: called inside strategy.run "
            "(replica context)") or run["reduce_refused"].startswith(
            "px.tf.ParameterServerStrategy.reduce: called inside strategy.run")
        assert float(facts["sum_none"]) == 2.5  # a value that is not distributed: as it is
        np.testing.assert_array_equal(facts["mean_none"], np.arange(3.0))
        np.testing.assert_array_equal(facts["sum_axis"], [3.0, 5.0, 7.0])
        np.testing.assert_array_equal(facts["mean_axis"], [1.0, 4.0])
        assert len(facts["local"]) == 1
    worker = coordinator.schedule(ps_testing.replica_facts, args=(strategy,)).fetch()
    assert worker["outside_run"] is None and worker["scope"] == "WorkerStrategy"  # in scope()
    assert strategy.num_replicas_in_sync == 1
    with pytest.raises(ValueError, match=r"px.tf.ParameterServerStrategy.reduce: axis=2 is out "
                                         r"of range for a value of rank 2 \(shape \(2, 3\)\)"):
        strategy.reduce("SUM", np.zeros((2, 3)), axis=2)


def test_variables_read_as_values_and_shards_update_alone(job):
    strategy, coordinator = job
    with strategy.scope():
        v = px.tf.Variable(np.arange(12, dtype=np.float32).reshape(4, 3), name="readable")
    assert [s.device for s in v.variables] == [
        "/job:ps/replica:0/task:0/device:CPU:0", "/job:ps/replica:0/task:1/device:CPU:0"]
    assert [s.name for s in v.variables] == ["readable/part_0", "readable/part_1"]
    before, after, doubled = coordinator.schedule(
        ps_testing.read_and_update, args=(v, np.ones((2, 3), np.float32))).fetch()
    values = np.arange(12, dtype=np.float32).reshape(4, 3)
    np.testing.assert_array_equal(before, values)
    values[2:] -= 1  # the last shard alone
    np.testing.assert_array_equal(after, values)
    np.testing.assert_array_equal(doubled, values * 2)
    np.testing.assert_array_equal(np.asarray(v), values)  # tf.convert_to_tensor(v)
    np.testing.assert_array_equal(v.numpy(), values)
    np.testing.assert_array_equal(np.ones(4) @ v, values.sum(0))
    np.testing.assert_array_equal(-v, -values)
    np.testing.assert_array_equal(v[1], values[1])
    np.testing.assert_array_equal(coordinator.fetch(v), values)
    v.assign_sub(np.full((4, 3), 0.5, np.float32)).assign_add(np.full((4, 3), 2.0, np.float32))
    np.testing.assert_array_equal(v.numpy(), values + 1.5)
    with pytest.raises(TypeError, match=r"ShardedVariable 'readable' is not iterable \(as "
                                        r"TensorFlow's\)"):
        list(v)
    with pytest.raises(AttributeError, match=r"ShardedVariable 'readable' has 2 shards on their "
                                             r"own servers: read each shard's "
                                             r"readable.variables\[i\].device"):
        v.device


def test_a_gradient_needs_an_optimizer_which_may_come_after_the_variables(ray_cluster):
    strategy = px.tf.ParameterServerStrategy(
        px.tf.RayClusterResolver(num_workers=1, num_ps=2),
        variable_partitioner=px.tf.FixedShardsPartitioner(2))
    try:
        with strategy.scope():
            w = px.tf.Variable(np.ones((4, 2), np.float32), name="w")
            steps = px.tf.Variable(np.zeros(1, np.float32), name="steps")
        with pytest.raises(ValueError, match=(
                r"ShardedVariable 'w': the parameter servers have no optimizer, and a pushed "
                r"gradient is what the servers' optimizer applies: on Ray the optimizer runs "
                r"on the servers, next to the variables\. Give the strategy one \(optimizer = "
                r"px.tf.ServerOptimizer\(optax.sgd\(0.1\)\) in strategy.scope\(\)")):
            w.apply_gradient(np.ones((4, 2)))
        np.testing.assert_array_equal(w.numpy(), np.ones((4, 2)))  # nothing was added
        w.assign_sub(np.full((4, 2), 0.25, np.float32))  # by hand: no optimizer needed
        with strategy.scope():  # after the variables: their values are kept
            optimizer = px.tf.ServerOptimizer(optax.sgd(0.5, momentum=0.9))
        grads = [np.arange(8, dtype=np.float32).reshape(4, 2), np.ones((2, 2), np.float32)]
        params, tx = np.full((4, 2), 0.75, np.float32), optax.sgd(0.5, momentum=0.9)
        state = tx.init(params)
        for _ in range(2):  # the whole variable, then its second shard with the whole
            optimizer.apply_gradients([(grads[0], w), (None, steps)])
            updates, state = tx.update(grads[0], state)
            params = np.asarray(optax.apply_updates(params, updates))
            steps.assign_add(np.ones(1, np.float32))  # ADD: the optimizer leaves it alone
        optimizer.apply_gradients([(grads[1], w.variables[1])])
        updates, state = tx.update(np.concatenate([np.zeros((2, 2)), grads[1]]), state)
        params = np.concatenate([params[:2], np.asarray(optax.apply_updates(params, updates))[2:]])
        np.testing.assert_allclose(w.numpy(), params, rtol=1e-6)
        np.testing.assert_array_equal(steps.numpy(), [2.0])
        with pytest.raises(ValueError, match="the servers already run another optimizer"):
            px.tf.ServerOptimizer(optax.adam(0.1), strategy=strategy)
        with pytest.raises(ValueError, match=r"px.tf.ServerOptimizer.apply_gradients: the "
                                             r"gradient for 'w' has shape \(2, 2\), the "
                                             r"variable \(4, 2\)"):
            optimizer.apply_gradients([(grads[1], w)])
    finally:
        strategy.shutdown()


def test_datasets_are_built_on_each_worker_as_tensorflow_builds_them(job):
    strategy, coordinator = job

    def per_worker_dataset_fn():  # TF: InputContext of one pipeline, id 0, on each worker
        return strategy.distribute_datasets_from_function(
            lambda context: iter([(context.num_input_pipelines, context.input_pipeline_id,
                                   context.num_replicas_in_sync)]))

    for dataset in (per_worker_dataset_fn, strategy.distribute_datasets_from_function(
            lambda context: iter([(context.num_input_pipelines, context.input_pipeline_id,
                                   context.num_replicas_in_sync)]))):
        iterator = iter(coordinator.create_per_worker_dataset(dataset))
        assert coordinator.schedule(ps_testing.next_element, args=(iterator,)).fetch() == (1, 0, 1)
    for dataset in ([3, 4], strategy.experimental_distribute_dataset([3, 4])):  # a copy each
        iterator = iter(coordinator.create_per_worker_dataset(dataset))
        assert [coordinator.schedule(ps_testing.next_element, args=(iterator,)).fetch()
                for _ in range(2)] == [3, 4]
    with pytest.raises(TypeError, match=r"ClusterCoordinator.create_per_worker_dataset: the "
                                        r"dataset does not travel to the workers"):
        coordinator.create_per_worker_dataset(x for x in range(3))
