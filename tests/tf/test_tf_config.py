"""TF_CONFIG with chief, worker and ps tasks for px.tf.ParameterServerStrategy."""

import json

import numpy as np
import optax
import pytest

import parallax as px

CLUSTER = {"chief": ["h0:2222"], "worker": ["h1:2222"], "ps": ["h2:2222", "h3:2222"]}


def resolver_for(task_type, index, cluster=CLUSTER):
    config = {"cluster": cluster, "task": {"type": task_type, "index": index}}
    return px.tf.TFConfigClusterResolver(environ={"TF_CONFIG": json.dumps(config)})


def test_tf_config_tasks_read_as_tensorflows_resolver():
    for task_type, index in [("chief", 0), ("worker", 0), ("ps", 1)]:
        resolver = resolver_for(task_type, index)
        assert (resolver.task_type, resolver.task_id) == (task_type, index)
        assert (resolver.num_workers, resolver.num_ps) == (1, 2)
        assert resolver.cluster_spec() == CLUSTER
    px.tf.Server(resolver_for("ps", 0)).join()  # returns: a Ray actor plays the task
    px.tf.Server(resolver_for("worker", 0)).join()


def test_tf_config_errors_are_named():
    with pytest.raises(ValueError, match=r"px.tf.TFConfigClusterResolver: TF_CONFIG lists no "
                                         r"'ps' tasks; parameter-server training needs at "
                                         r"least one worker and one ps\. Expected JSON"):
        resolver_for("chief", 0, {"chief": ["a:1"], "worker": ["b:1"]})
    with pytest.raises(ValueError, match=r"TF_CONFIG task ps:2 is not in the cluster, which "
                                         r"lists 2 ps task\(s\)"):
        resolver_for("ps", 2)
    with pytest.raises(ValueError, match="TF_CONFIG is not set"):
        px.tf.TFConfigClusterResolver(environ={})
    with pytest.raises(ValueError, match=r"has jobs \['trainer'\]"):
        resolver_for("chief", 0, dict(CLUSTER, trainer=["x:1"]))
    with pytest.raises(ValueError, match="px.tf.Server: this process is task chief:0"):
        px.tf.Server(resolver_for("chief", 0))


def test_only_the_chief_creates_the_strategy():
    with pytest.raises(ValueError, match=r"px.tf.ParameterServerStrategy: this process is "
                                         r"TF_CONFIG task ps:1; only the chief creates the "
                                         r"strategy\."):
        px.tf.ParameterServerStrategy(resolver_for("ps", 1))


def test_variables_outside_a_parameter_server_scope_are_refused():
    with pytest.raises(ValueError, match=r"px.tf.Variable: called outside any strategy's scope; "
                                         r"create parameter-server variables inside `with "
                                         r"strategy.scope\(\):`"):
        px.tf.Variable(np.zeros(2))
    with px.tf.MirroredStrategy().scope():
        with pytest.raises(ValueError, match="called inside the scope of MirroredStrategy"):
            px.tf.Variable(np.zeros(2))


@pytest.mark.xdist_group("ray")
@pytest.mark.slow
def test_the_chief_starts_one_server_per_ps_task_and_scope_places_variables(ray_cluster):
    """One server per ps task; variables created in scope() are partitioned, placed
    round-robin, and train as the one-process optax run does (3 steps of momentum SGD)."""
    tx = optax.sgd(0.1, momentum=0.9)
    with px.tf.ParameterServerStrategy(
            resolver_for("chief", 0),
            variable_partitioner=px.tf.MaxSizePartitioner(max_shard_bytes=24)) as strategy:
        assert strategy.store.num_servers == 2 and strategy.num_workers == 1
        strategy.set_optimizer(tx)
        rng = np.random.default_rng(0)
        initial = {"w": rng.standard_normal((4, 3)).astype(np.float32),
                   "b": rng.standard_normal((3,)).astype(np.float32)}
        with strategy.scope():
            assert px.tf.get_replica_context() is None  # cross-replica, as in TensorFlow
            variables = {name: px.tf.Variable(value, name=name)
                         for name, value in initial.items()}
        # w: 48 bytes -> 2 shards on servers 0, 1; b: 12 bytes -> 1 shard, next in turn: 0
        assert [s.server for s in variables["w"].shards] == [0, 1]
        assert [s.server for s in variables["b"].shards] == [0]
        params, state = dict(initial), tx.init(initial)
        for step in range(3):
            grads = {name: rng.standard_normal(v.shape).astype(np.float32)
                     for name, v in initial.items()}
            for name, variable in variables.items():
                variable.apply_gradient(grads[name])
            updates, state = tx.update(grads, state, params)
            params = optax.apply_updates(params, updates)
        assert px.testing.relative_difference(
            {name: v.read() for name, v in variables.items()}, params) <= 1e-6
