import pytest

import parallax.ps  # sets Ray's single-node mode before ray is imported
import ray.cloudpickle  # noqa: E402

from ps import ps_testing

# Ray workers do not have tests/ on sys.path: ship the worker programs by value.
ray.cloudpickle.register_pickle_by_value(ps_testing)


@pytest.fixture(scope="session")
def store(ray_cluster):
    """Three servers shared by the Ray tests (each test resets them: processes cost seconds)."""
    with parallax.ps.KVStore(num_servers=3, num_workers=3) as kv:
        yield kv
