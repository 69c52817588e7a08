import math

import pytest

import parallax as px
from parallax.ps.consistency import VectorClock


def test_named_models_are_bounded_delays():
    assert px.ps.as_consistency("sequential") == px.ps.BoundedDelay(0)
    assert px.ps.as_consistency("eventual") == px.ps.BoundedDelay(math.inf)
    assert not px.ps.BoundedDelay(math.inf).waits


def test_bounded_delay_admits_iteration_t_once_all_finished_t_minus_tau_minus_1():
    model = px.ps.BoundedDelay(2)
    # iteration 5 needs every worker to have finished iteration 2, i.e. 3 iterations done
    assert not model.ready(5, slowest=2)
    assert model.ready(5, slowest=3)
    assert px.ps.BoundedDelay(0).ready(1, slowest=1) and not px.ps.BoundedDelay(0).ready(2, 1)


def test_vector_clock_advances_over_gap_free_iterations_only():
    clock = VectorClock(3)
    clock.finish(1, 1)
    clock.finish(1, 2)
    assert clock.clock.tolist() == [0, 0, 0]
    clock.finish(1, 0)
    assert clock.clock.tolist() == [0, 3, 0]
    clock.finish(1, 0)  # an at-least-once re-run changes nothing
    assert clock.clock.tolist() == [0, 3, 0] and clock.slowest() == 0


@pytest.mark.parametrize("value, error, match", [
    (-1, ValueError, "tau must be >= 0"),
    (1.5, ValueError, "whole number"),
    ("2", TypeError, "tau must be a number"),
])
def test_bad_tau(value, error, match):
    with pytest.raises(error, match=match):
        px.ps.BoundedDelay(value)


def test_bad_model_name():
    with pytest.raises(ValueError, match="'sequential', 'eventual' or px.ps.BoundedDelay"):
        px.ps.as_consistency("strict")
