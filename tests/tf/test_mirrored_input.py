"""Distributed datasets: global batches split over replicas, per-worker input functions."""

import numpy as np
import pytest

import parallax as px


def test_global_batches_are_split_in_replica_order():
    strategy = px.tf.MirroredStrategy()
    data = [{"x": np.arange(32.0).reshape(16, 2) + 100 * step, "y": np.arange(16)}
            for step in range(2)]
    batches = list(strategy.experimental_distribute_dataset(data))
    assert len(batches) == 2
    x = batches[1]["x"]
    assert isinstance(x, px.tf.PerReplica) and x.shape == (2, 2)
    for r, component in enumerate(x.values):
        np.testing.assert_array_equal(component, data[1]["x"][2 * r:2 * r + 2])
        assert component.devices() == {strategy.devices[r]}
    assert list(strategy.experimental_distribute_dataset(data))[0]["y"].values[7].tolist() == [14, 15]


def test_datasets_from_function_take_one_element_per_replica():
    strategy = px.tf.MirroredStrategy()
    contexts = []

    def dataset_fn(ctx):
        contexts.append(ctx)
        batch = ctx.get_per_replica_batch_size(24)
        return ({"x": np.full((batch, 1), i, np.float32)} for i in range(19))

    steps = list(strategy.distribute_datasets_from_function(dataset_fn))
    assert contexts == [px.tf.InputContext(num_input_pipelines=1, input_pipeline_id=0,
                                           num_replicas_in_sync=8)]
    # 19 elements: two steps of 8, then TF's last step: 3 replicas with data, 5 empty.
    assert len(steps) == 3
    assert [float(v[0, 0]) for v in steps[1]["x"].values] == list(range(8, 16))
    assert steps[0]["x"].shape == (3, 1) and steps[0]["x"].rows is None
    assert steps[2]["x"].rows == (3, 3, 3, 0, 0, 0, 0, 0)
    assert [v.shape[0] for v in steps[2]["x"].values] == [3, 3, 3, 0, 0, 0, 0, 0]


def test_bad_global_batches_are_refused():
    strategy = px.tf.MirroredStrategy()
    with pytest.raises(ValueError, match=r"px.tf.MirroredStrategy.experimental_distribute_dataset: "
                                         r"element 1 of the dataset has leaves with different "
                                         r"numbers of rows \(16 at \['x'\], 12 at \['y'\]\)"):
        list(strategy.experimental_distribute_dataset(
            [{"x": np.zeros(16), "y": np.zeros(16)}, {"x": np.zeros(16), "y": np.zeros(12)}]))
    with pytest.raises(ValueError, match=r"element 0 of the dataset has a scalar at \['x'\]; "
                                         r"every leaf needs a leading batch dimension"):
        list(strategy.experimental_distribute_dataset([{"x": np.float32(1.0)}]))
    with pytest.raises(ValueError, match=r"px.tf.InputContext.get_per_replica_batch_size: the "
                                         r"global batch size 20 is not divisible by "
                                         r"num_replicas_in_sync=8; use a multiple of 8, e.g. 24"):
        strategy.input_context().get_per_replica_batch_size(20)
    with pytest.raises(ValueError, match=r"the per-replica elements of one step differ in "
                                         r"structure, dtype or shape beyond the batch dimension"):
        list(strategy.distribute_datasets_from_function(
            lambda ctx: [np.zeros((2, 1))] * 7 + [np.zeros((2, 3))]))
    with pytest.raises(TypeError, match=r"distribute_datasets_from_function: dataset_fn must "
                                        r"be callable"):
        strategy.distribute_datasets_from_function([np.zeros(8)])
