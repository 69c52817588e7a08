"""tf.distribute.InputOptions: TF's fields, defaults and rules; what parallax honours or refuses."""

import numpy as np
import pytest

import parallax as px

EDD = "px.tf.MirroredStrategy.experimental_distribute_dataset"
DDFF = "px.tf.MirroredStrategy.distribute_datasets_from_function"
PER_REPLICA = px.tf.InputReplicationMode.PER_REPLICA


def test_defaults_are_tensorflows():
    options = px.tf.InputOptions()
    assert options == px.tf.InputOptions(
        experimental_fetch_to_device=True,
        experimental_replication_mode=px.tf.InputReplicationMode.PER_WORKER,
        experimental_place_dataset_on_device=False, experimental_per_replica_buffer_size=1)


def test_buffer_sizes_give_the_same_batches():
    strategy = px.tf.MirroredStrategy()
    data = [np.arange(16.0) + 100 * i for i in range(3)]
    want = [b.values for b in strategy.experimental_distribute_dataset(data)]
    for size in (0, 1, 5):
        options = px.tf.InputOptions(experimental_per_replica_buffer_size=size)
        got = [b.values for b in strategy.experimental_distribute_dataset(data, options)]
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_per_replica_builds_one_pipeline_per_replica():
    strategy = px.tf.MirroredStrategy()
    contexts = []

    def dataset_fn(ctx):
        contexts.append(ctx)
        steps = 2 if ctx.input_pipeline_id < 3 else 1  # three pipelines have one more step
        return [np.full((2, 1), 10 * ctx.input_pipeline_id + s, np.float32) for s in range(steps)]

    options = px.tf.InputOptions(experimental_replication_mode="PER_REPLICA")
    steps = list(strategy.distribute_datasets_from_function(dataset_fn, options))
    assert contexts == [px.tf.InputContext(8, i, 8) for i in range(8)]
    assert [v[0, 0] for v in steps[0].values] == [10.0 * i for i in range(8)]
    # TF: the step runs while any pipeline has data; the ended ones get empty batches.
    assert steps[1].rows == (2, 2, 2, 0, 0, 0, 0, 0)
    assert [v[:, 0].tolist() for v in steps[1].values][:4] == [[1.0, 1.0], [11.0, 11.0],
                                                               [21.0, 21.0], []]


@pytest.mark.parametrize("kwargs, method, error, message", [
    (dict(experimental_replication_mode=PER_REPLICA), "edd", NotImplementedError,
     f"{EDD}: InputReplicationMode.PER_REPLICA is only supported in "
     "`distribute_datasets_from_function` (TensorFlow's rule); use PER_WORKER, the default."),
    (dict(experimental_place_dataset_on_device=True), "ddff", ValueError,
     f"{DDFF}: when `experimental_place_dataset_on_device` is set for dataset placement, you "
     "must also specify `PER_REPLICA` for the replication mode (TensorFlow's rule)."),
    (dict(experimental_replication_mode=PER_REPLICA, experimental_place_dataset_on_device=True),
     "ddff", ValueError, f"{DDFF}: `experimental_place_dataset_on_device` can not be set to "
     "True when experimental_fetch_to_device is True and replication mode is set to "
     "`PER_REPLICA` (TensorFlow's rule)."),
    (dict(experimental_replication_mode=PER_REPLICA, experimental_place_dataset_on_device=True,
          experimental_fetch_to_device=False), "ddff", ValueError,
     f"{DDFF}: experimental_place_dataset_on_device=True is not supported: TensorFlow then "
     "runs the tf.data pipeline's ops on the accelerator, and a parallax input pipeline is a "
     "Python iterable that runs on the host."),
    (dict(experimental_fetch_to_device=False), "edd", ValueError,
     f"{EDD}: experimental_fetch_to_device=False is not supported: a PerReplica value is one "
     "array sharded over the replicas' devices, so splitting a batch is putting it on the "
     "devices; there is no host-resident per-replica value."),
])
def test_bad_options_are_refused(kwargs, method, error, message):
    strategy = px.tf.MirroredStrategy()
    options = px.tf.InputOptions(**kwargs)
    with pytest.raises(error, match="^" + __import__("re").escape(message)):
        if method == "edd":
            strategy.experimental_distribute_dataset([], options)
        else:
            strategy.distribute_datasets_from_function(lambda ctx: [], options)


def test_bad_option_values_are_refused():
    with pytest.raises(ValueError, match=r"px.tf.InputOptions: "
                       r"experimental_per_replica_buffer_size=-1 must be an int >= 0"):
        px.tf.InputOptions(experimental_per_replica_buffer_size=-1)
    with pytest.raises(ValueError, match=r"experimental_replication_mode='PER_HOST' must be "
                       r"px.tf.InputReplicationMode.PER_WORKER or PER_REPLICA"):
        px.tf.InputOptions(experimental_replication_mode="PER_HOST")
    with pytest.raises(TypeError, match=rf"{EDD}: options must be a px.tf.InputOptions "
                       r"\(TF's tf.distribute.InputOptions\) or None; got dict"):
        px.tf.MirroredStrategy().experimental_distribute_dataset([], {"prefetch": 1})


def test_multi_worker_refuses_per_replica_as_tensorflow():
    strategy = px.tf.MultiWorkerMirroredStrategy()  # one process here
    options = px.tf.InputOptions(experimental_replication_mode=PER_REPLICA)
    with pytest.raises(NotImplementedError, match=r"distribute_datasets_from_function: "
                       r"InputReplicationMode.PER_REPLICA is only supported in "
                       r"`distribute_datasets_from_function` of tf.distribute.MirroredStrategy"):
        strategy.distribute_datasets_from_function(lambda ctx: [], options)
