"""Every ``Example:`` in parallax's docstrings runs (on the 8 simulated devices of the tests)."""

import doctest
import importlib
import pkgutil

import pytest

import parallax

MODULES = sorted(
    m.name for m in pkgutil.walk_packages(parallax.__path__, "parallax.")
    if not m.name.endswith("__main__")
)


# Modules whose examples start Ray actors: they run in the session's one Ray cluster, on the
# xdist worker that runs the other Ray tests.
RAY = ("parallax.ps.", "parallax.rpc.", "parallax.ray_cluster.", "parallax.tf.parameter_server")
PARAMS = [pytest.param(m, marks=pytest.mark.xdist_group("ray")) if m.startswith(RAY) else m
          for m in MODULES]


@pytest.mark.parametrize("name", PARAMS)
def test_examples_run(name, request):
    if name.startswith(RAY):
        request.getfixturevalue("ray_cluster")
    if name.startswith("parallax.rpc."):  # its examples start their own RPC group
        from parallax.rpc.agent import agent_or_none

        if agent_or_none() is not None:  # tests/rpc's (their fixture restarts it when needed)
            importlib.import_module("parallax.rpc").shutdown(timeout=10)
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
