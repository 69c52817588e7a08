"""Ray for the parameter-server tests of ``parallax.tf`` (test_parameter_server.py,
test_coordinator.py): one cluster per session, grouped on one xdist worker."""

import parallax.ps  # noqa: F401  (sets Ray's single-node mode before ray is imported)
import ray.cloudpickle

from tf import ps_testing

# Ray workers do not have tests/ on sys.path: ship the worker programs by value.
ray.cloudpickle.register_pickle_by_value(ps_testing)
