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
# Modules whose examples take more than about 2 s of one core (docs/design.md, "Test suite
# time"): the fast lane (-m "not slow") leaves them out.
SLOW = {"parallax.horovod.adasum", "parallax.models.gpt", "parallax.nn.layers",
        "parallax.models.llama", "parallax.models.mixtral", "parallax.nn.llama_layers",
        "parallax.nn.moe",
        "parallax.metrics.evaluation", "parallax.pipeline.update", "parallax.ps.kvstore", "parallax.ps.simple_app",
        "parallax.ps.worker", "parallax.ps.workers", "parallax.strategies.context_parallel.strategy",
        "parallax.strategies.context_parallel.stage_groups",
        "parallax.strategies.context_parallel.ring", "parallax.testing",
        "parallax.tf.parameter_server.coordinator", "parallax.tf.parameter_server.embedding",
        "parallax.tf.parameter_server.strategy", "parallax.tf.parameter_server.server_model",
        "parallax.tf.parameter_server.server_optimizer",
        "parallax.tf.parameter_server.sharded_variable"}


def marks(name):
    return ([pytest.mark.xdist_group("ray")] if name.startswith(RAY) else []) + (
        [pytest.mark.slow] if name in SLOW else [])


PARAMS = [pytest.param(m, marks=marks(m)) for m in MODULES]


def test_the_slow_examples_name_modules():
    """A module moved or renamed must not leave its slow examples in the fast lane."""
    assert not SLOW - set(MODULES), f"not modules of parallax: {sorted(SLOW - set(MODULES))}"


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
