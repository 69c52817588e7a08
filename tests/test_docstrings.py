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


@pytest.mark.parametrize("name", MODULES)
def test_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
