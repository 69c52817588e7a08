"""The closed forms of parallax.planner.schedule_facts equal the schedules' own tables."""

import pytest

from parallax.pipeline import schedule
from parallax.planner import schedule_facts


def _grid(stages):
    cases = [(name, p, m, None) for name in ("gpipe", "1f1b") for p in stages
             for m in sorted({2, max(2, p - 1), p, p + 1, 2 * p + 1, 3 * p})]
    return cases + [("interleaved_1f1b", p, k * p, v) for p in stages if p >= 3
                    for k in (1, 2, 3) for v in (2, 3, 4) if k > 1 or p >= 8]


FAST = _grid((2, 3, 4, 5, 8))
# The interleaved inbox grows from p = 11 on: checked there too (slower).
SLOW = [pytest.param(*case, marks=pytest.mark.slow) for case in _grid((11, 14, 20))
        if case[0] == "interleaved_1f1b" or case[2] <= 2 * case[1] + 1]


@pytest.mark.parametrize("name,p,m,v", FAST + SLOW)
def test_closed_forms_equal_the_tables(name, p, m, v):
    closed = schedule_facts.facts(name, p, m, v)
    assert not closed.from_table
    table = schedule_facts.of_table(schedule(name, p, m, v))
    assert (closed.ticks, closed.peak, closed.rows) == (table.ticks, table.peak, table.rows)
    assert closed.bubble == pytest.approx(table.bubble, abs=1e-12)


def test_other_schedules_and_sizes_read_their_tables():
    assert schedule_facts.facts("1f1b", 1, 8).from_table             # one stage
    assert schedule_facts.facts("interleaved_1f1b", 4, 4, 2).from_table  # m = p, p < 8
    assert schedule_facts.facts("zb_h1", 4, 8).from_table            # not a closed form
    assert schedule_facts.facts("1f1b", 4, 8, split_backward=True).from_table
    with pytest.raises(ValueError, match="multiple"):
        schedule_facts.facts("interleaved_1f1b", 4, 6, 2)
