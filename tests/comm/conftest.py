"""Fixtures for the parallax.comm tests; the helpers live in comm_testing.py."""

import pytest

from .comm_testing import line_mesh


@pytest.fixture(scope="session")
def mesh8():
    """A 1D mesh ``x`` over all 8 devices."""
    return line_mesh(8)
