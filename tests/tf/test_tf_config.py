"""TF_CONFIG with chief, worker and ps tasks for px.tf.ParameterServerStrategy."""

import json

import numpy as np
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
    resolver = resolver_for("ps", 1)  # TensorFlow's own arguments, as its tutorial passes them
    server = px.tf.Server(resolver.cluster_spec(), job_name=resolver.task_type,
                          task_index=resolver.task_id, protocol=resolver.rpc_layer or "grpc",
                          start=True)
    assert (server.resolver.task_type, server.resolver.task_id) == ("ps", 1)
    server.join()


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
    with pytest.raises(ValueError, match="px.tf.Server: this process is task chief:0"):
        px.tf.Server(CLUSTER, job_name="chief", task_index=0)
    with pytest.raises(TypeError, match=r"px.tf.Server: pass this process's "
                                        r"px.tf.TFConfigClusterResolver, or TensorFlow's"):
        px.tf.Server("grpc://h1:2222")


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
