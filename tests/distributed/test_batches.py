"""process_slice and global_batch in one process (the multi-process shape check runs in
tests/horovod/programs/collectives.py; the strategies in tests/distributed/programs/)."""

import re

import numpy as np
import pytest

import parallax as px


def test_process_slice_follows_the_batch_sharding():
    assert px.distributed.process_slice(64) == slice(0, 64)
    pipeline = px.compose(px.DataParallel("data"), px.Pipeline("stage", microbatches=2))
    assert px.distributed.process_slice(8, px.make_mesh(stage=2, data=4), pipeline) == slice(0, 8)
    with pytest.raises(ValueError, match=re.escape(
            "px.distributed.process_slice: a global batch of 12 rows does not split over the "
            "8 batch shards (data=8) of DataParallel('data') on the mesh data=8 (8 cpu "
            "devices); use a multiple of 8.")):
        px.distributed.process_slice(12, px.make_mesh(data=8), px.DataParallel("data"))
    with pytest.raises(ValueError, match=r"global_batch_size=0 must be >= 1"):
        px.distributed.process_slice(0)
    with pytest.raises(TypeError, match=r"pass strategy= with mesh="):
        px.distributed.process_slice(8, px.make_mesh(data=8))


def test_global_batch_in_one_process_places_the_batch():
    mesh, strategy = px.make_mesh(data=4, fsdp=2), px.FSDP("fsdp")
    batch = px.distributed.global_batch({"x": np.arange(16.0).reshape(8, 2)}, mesh,
                                        px.compose(px.DataParallel("data"), strategy))
    assert batch["x"].sharding.spec == px.step.batch.batch_spec(
        px.compose(px.DataParallel("data"), strategy))
    np.testing.assert_array_equal(batch["x"], np.arange(16.0).reshape(8, 2))
    with pytest.raises(TypeError, match=r"px.distributed.global_batch: strategy must be a "
                                        r"px.Strategy, got str"):
        px.distributed.global_batch({"x": np.ones(8)}, mesh, "dp")
    with pytest.raises(ValueError, match=r"px.distributed.global_batch: the batch leaf \['x'\] "
                                         r"has shape \(6, 2\): its leading \(batch\) dimension 6 "
                                         r"is not divisible by the 8 batch shards"):
        px.distributed.global_batch({"x": np.ones((6, 2))}, mesh,
                                    px.compose(px.DataParallel("data"), strategy))
