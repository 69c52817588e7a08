"""Schedules as data: orders, the lock-step cost model, validation, buffers, text and plots."""

import doctest
import heapq
import importlib
import itertools
import pathlib
import sys

import numpy as np
import pytest

from parallax.pipeline import SCHEDULES, Action, Schedule, schedule

SIZES = [(p, m) for p in (1, 2, 3, 4, 8) for m in sorted({1, 2, 3, p, 2 * p, 4 * p})]
INTERLEAVED = [(p, m, v) for p in (1, 2, 4) for m in (p, 2 * p) for v in (2, 3)]


def classic(p, m, v=1):
    return (p - 1) / (v * m + p - 1)


def split_formula(p, m, v=1):
    return 2 * (p - 1) / (3 * v * m + 2 * (p - 1))


def named_schedules():
    for name in ("gpipe", "1f1b"):
        for p, m in [(1, 3), (2, 2), (3, 5), (4, 8)]:
            for split in (False, True):
                yield schedule(name, p, m, split_backward=split)
    for p, m, v in [(2, 2, 2), (2, 4, 3), (4, 8, 2)]:
        for split in (False, True):
            yield schedule("interleaved_1f1b", p, m, v, split_backward=split)


# -- orders ----------------------------------------------------------------------------


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize(
    "p,m", [(p, f * p) for p in (2, 4) for f in (1, 2, 4)] + [(4, 1), (4, 2), (4, 3)]
)  # m <= p - 1: stages 0 .. p - m - 1 warm up with all m forwards, then only backwards
def test_1f1b_order_is_warmup_then_alternating_then_cooldown(p, m, split):
    s = schedule("1f1b", p, m, split_backward=split)
    for stage in range(p):
        warmup = min(p - stage - 1, m)
        expected = [f"F{j}" for j in range(warmup)]
        for j in range(m - warmup):
            expected += [f"F{warmup + j}", f"B{j}"]  # the first steady action is F_warmup
        expected += [f"B{j}" for j in range(m - warmup, m)]
        order = s.order(stage)
        assert [x for x in order if x[0] != "W"] == expected
        for i, x in enumerate(order):  # each W right after its B
            if x[0] == "B":
                assert order[i + 1] == "W" + x[1:]


def test_gpipe_order_is_all_forwards_then_all_backwards():
    s = schedule("gpipe", 3, 4)
    assert s.order(1) == ["F0", "F1", "F2", "F3", "B0", "W0", "B1", "W1", "B2", "W2", "B3", "W3"]


def test_interleaved_order_follows_megatron():
    s = schedule("interleaved_1f1b", 4, 8, 2)
    # stage 0 warms up with 2 (p - 1) + (v - 1) p = 10 forwards, micro-batches in groups of p
    assert s.order(0)[:14] == [
        "F0.0", "F1.0", "F2.0", "F3.0", "F0.1", "F1.1", "F2.1", "F3.1", "F4.0", "F5.0",
        "F6.0", "B0.1", "W0.1", "F7.0",
    ]  # fmt: skip
    # the last stage warms up with (v - 1) p = 4; backwards start on the last chunk
    assert s.order(3)[:8] == ["F0.0", "F1.0", "F2.0", "F3.0", "F0.1", "B0.1", "W0.1", "F1.1"]


@pytest.mark.parametrize("sched", list(named_schedules()), ids=repr)
def test_from_orders_rebuilds_the_named_table(sched):
    rebuilt = Schedule.from_orders(
        [sched.order(s) for s in range(sched.stages)],
        split_backward=sched.split_backward,
        name=sched.name,
    )
    assert rebuilt == sched
    drawn = Schedule.from_table(
        [
            " ".join(sched.label(r[s]) if r[s] else "." for r in sched.table)
            for s in range(sched.stages)
        ],
        split_backward=sched.split_backward,
        name=sched.name,
    )
    assert drawn == sched


def test_from_orders_inserts_w_after_each_b():
    s = Schedule.from_orders(["F0 F1 B0 B1", "F0 B0 F1 B1"])
    assert s.order(0) == ["F0", "F1", "B0", "W0", "B1", "W1"]
    assert s.ticks == 9 and s.microbatches == 2 and s.virtual_stages == 1


# -- the lock-step cost model ----------------------------------------------------------


@pytest.mark.parametrize("p,m", SIZES)
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_fused_bubble_equals_the_classic_formula(name, p, m):
    s = schedule(name, p, m)
    assert s.bubble_fraction(f=1, b=1, w=1) == pytest.approx(classic(p, m), abs=1e-12)
    assert s.ticks == 3 * (m + p - 1)  # every tick costs 1: F, B and W cost 1


@pytest.mark.parametrize("p,m", SIZES)
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_split_bubble_is_below_the_classic_formula(name, p, m):
    bubble = schedule(name, p, m, split_backward=True).bubble_fraction(f=1, b=1, w=1)
    assert bubble <= classic(p, m) + 1e-12
    assert bubble == pytest.approx(split_formula(p, m), abs=1e-12)


@pytest.mark.parametrize("p,m,v", INTERLEAVED + [(p, 4 * p, v) for p in (2, 4) for v in (2, 3)])
def test_interleaved_bubble(p, m, v):
    fused = schedule("interleaved_1f1b", p, m, v).bubble_fraction(f=1, b=1, w=1)
    split = schedule("interleaved_1f1b", p, m, v, split_backward=True).bubble_fraction(f=1, b=1, w=1)
    assert fused <= classic(p, m, v) + 1e-12
    assert fused == pytest.approx(classic(p, m, v), abs=1e-12)
    assert split == pytest.approx(split_formula(p, m, v), abs=1e-12)
    assert schedule("interleaved_1f1b", p, m, v).bubble_fraction() < classic(p, m) or p == 1


def test_a_tick_costs_its_slowest_action_on_every_stage():
    # tick 4 mixes a B (stage 0) and a forward (stage 1): with B = W = 2 it costs 2
    s = Schedule.from_table(["F0 F1 .  .  B0 W0 .  B1 W1", ".  F0 B0 W0 F1 B1 W1"])
    assert s.time(f=1, b=2, w=2) == 1 + 1 + 2 * 7
    assert s.bubble_fraction(f=1, b=2, w=2, lockstep=True) == pytest.approx(1 - 2 * (1 + 4) / 16)
    assert s.time(f=1, b=1.5, w=0.5) == 1 + 1 + 1.5 + 0.5 + 1.5 + 1.5 + 0.5 + 1.5 + 0.5
    # The papers' replay does not make stage 1's F1 wait for stage 0's slower B0: it takes
    # the classic (m + p - 1)(f + b + w) = 15 where the lock-step ticks take 16.
    assert s.makespan(f=1, b=2, w=2) == 15
    assert s.bubble_fraction(f=1, b=2, w=2) == pytest.approx(1 / 3)


def test_costs_are_checked():
    s = schedule("1f1b", 2, 2)
    with pytest.raises(ValueError, match="cost f must be a positive number, got 0"):
        s.bubble_fraction(f=0)
    with pytest.raises(ValueError, match=r"cost w \(the weight-gradient part of a backward, T_W\) "
                       r"must be a number >= 0, got -1; f, b and w are the times of one F, "
                       r"one B and one W"):
        s.bubble_fraction(w=-1)


def _best_lockstep_time(orders, cost):
    """Optimal lock-step time of fixed per-stage orders whose backward is ONE action.

    Dijkstra over per-stage progress; each tick advances any subset of ready stages and
    costs the slowest action advanced.
    """
    p = len(orders)
    done = lambda state, s, a: a in orders[s][: state[s]]  # noqa: E731

    def ready(state, s):
        if state[s] == len(orders[s]):
            return False
        kind, j = orders[s][state[s]]
        if kind == "F":
            return s == 0 or done(state, s - 1, ("F", j))
        return s == p - 1 or done(state, s + 1, ("B", j))

    start, goal = (0,) * p, tuple(map(len, orders))
    best, queue = {start: 0}, [(0, start)]
    while queue:
        d, state = heapq.heappop(queue)
        if state == goal:
            return d
        runnable = [s for s in range(p) if ready(state, s)]
        for k in range(1, len(runnable) + 1):
            for subset in itertools.combinations(runnable, k):
                nxt = tuple(x + (s in subset) for s, x in enumerate(state))
                nd = d + max(cost[orders[s][state[s]][0]] for s in subset)
                if nd < best.get(nxt, float("inf")):
                    best[nxt] = nd
                    heapq.heappush(queue, (nd, nxt))


def test_a_one_tick_fused_backward_cannot_reach_the_classic_bubble():
    # Why a backward takes two ticks: with one action of cost 2, the best placement of the
    # 1F1B orders pays more than (m + p - 1)(f + b), because ticks mixing F and B cost 2.
    p, m = 2, 4
    orders = [
        [(a.kind, a.microbatch) for a in schedule("1f1b", p, m).actions(s) if a.kind != "W"]
        for s in range(p)
    ]
    assert _best_lockstep_time(orders, {"F": 1, "B": 2}) == 17 > 3 * (m + p - 1)
    assert schedule("1f1b", p, m).time() == 3 * (m + p - 1)


# -- memory ----------------------------------------------------------------------------


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("p,m", SIZES)
def test_peak_in_flight(p, m, split):
    one = schedule("1f1b", p, m, split_backward=split)
    gpipe = schedule("gpipe", p, m, split_backward=split)
    for s in range(p):
        assert one.peak_in_flight(s) == min(p - s, m)
        assert gpipe.peak_in_flight(s) == m


@pytest.mark.parametrize("p,m,v", INTERLEAVED + [(8, 8, 2), (4, 12, 3)])
def test_interleaved_peak_in_flight(p, m, v):
    s = schedule("interleaved_1f1b", p, m, v)
    # Megatron: warm-up 2 (p - s - 1) + (v - 1) p forwards, then one more before the first W
    assert [s.peak_in_flight(k) for k in range(p)] == [
        min(2 * (p - k - 1) + (v - 1) * p + 1, v * m) for k in range(p)
    ]


# -- validation ------------------------------------------------------------------------


def test_a_backward_before_the_next_stages_backward_is_rejected():
    rows = ["F0 .  B0 W0", ".  F0 .  B0 W0"]
    with pytest.raises(
        ValueError,
        match=r"schedule: B0 on stage 0 at tick 2 runs before B0 on stage 1 \(tick 3\); "
        r"a backward needs the gradient from the next stage first",
    ):
        Schedule.from_table(rows, split_backward=True)


def test_fused_backward_waits_for_the_next_stages_w():
    rows = ["F0 .  .  B0 W0", ".  F0 B0 W0"]
    with pytest.raises(
        ValueError,
        match=r"B0 on stage 0 at tick 3 runs in the same tick as W0 on stage 1 \(tick 3\)",
    ):
        Schedule.from_table(rows)
    Schedule.from_table(rows, split_backward=True)  # valid once split


@pytest.mark.parametrize(
    "rows,split,message",
    [
        (
            ["F0 .  .  .  B0 W0", "F0 .  B0 W0"],
            False,
            r"F0 on stage 1 at tick 0 runs in the same tick as F0 on stage 0 \(tick 0\); a forward "
            r"needs the previous stage's activation, which arrives one tick after it is sent",
        ),
        (
            ["B0 F0 W0"],
            False,
            r"B0 on stage 0 at tick 0 runs before F0 on stage 0 \(tick 1\); a backward needs its "
            r"own forward's residuals",
        ),
        (
            ["F0 W0 B0"],
            True,
            r"W0 on stage 0 at tick 1 runs before B0 on stage 0 \(tick 2\); a weight gradient",
        ),
        (
            ["F0 B0 .  W0"],
            False,
            r"W0 on stage 0 at tick 3 does not directly follow its B \(tick 1\); "
            r"with split_backward=False",
        ),
        (
            ["F0 B0"],
            False,
            r"schedule: W0 is missing on stage 0; every \(stage, micro-batch, chunk\) needs one F, "
            r"one B and one W",
        ),
        (
            ["F0 B0 W0 F0"],
            False,
            r"schedule: F0 appears 2 times on stage 0 \(ticks 0, 3\); every action runs exactly "
            r"once",
        ),
        (
            ["F0.0 F0.1 . . . B0.1 W0.1 B0.0 W0.0", ". F0.0 . F0.1 B0.1 W0.1 B0.0 W0.0"],
            True,
            r"F0.1 on stage 0 at tick 1 runs in the same tick as F0.0 on stage 1 \(tick 1\)",
        ),
    ],
)
def test_broken_tables_are_rejected(rows, split, message):
    with pytest.raises(ValueError, match=message):
        Schedule.from_table(rows, split_backward=split)


def test_out_of_range_and_unreadable_cells():
    with pytest.raises(
        ValueError, match=r"F1 on stage 0 at tick 1 is out of range: .* micro-batches 0..0"
    ):
        Schedule.from_table(["F0 F1 B0 W0 B1 W1"], microbatches=1)
    with pytest.raises(ValueError, match=r"cannot read 'X3' as an action"):
        Schedule.from_table(["F0 X3"])
    with pytest.raises(TypeError, match="a cell must be an Action"):
        Schedule.from_table([[Action("F", 0), 3]])


def test_orders_that_deadlock_are_rejected():
    with pytest.raises(
        ValueError,
        match=r"the orders deadlock at tick 1: stage 0's next action B0 needs W0 on stage 1; "
        r"stage 1's next action B0 needs F0 on stage 1",
    ):
        Schedule.from_orders(["F0 B0", "B0 F0"])
    with pytest.raises(ValueError, match="B1 is missing on stage 0"):
        Schedule.from_orders(["F0 F1 B0"])
    with pytest.raises(ValueError, match="holds an idle cell"):
        Schedule.from_orders(["F0 . B0"])


# -- bad input to schedule() -----------------------------------------------------------


@pytest.mark.parametrize(
    "args,kwargs,error,message",
    [
        (
            ("pipedream", 4, 8),
            {},
            ValueError,
            r"unknown schedule 'pipedream'; known: gpipe, 1f1b, interleaved_1f1b, zb_h1, zb_h2, "
            r"interleaved_zb, zbv, dualpipev",
        ),
        (("1f1b", 0, 8), {}, ValueError, r"stages must be >= 1, got 0"),
        (("1f1b", 4, 0), {}, ValueError, r"microbatches must be >= 1, got 0"),
        (
            ("gpipe", 4, 8, 2),
            {},
            ValueError,
            r"virtual_stages=2 needs 'interleaved_1f1b', 'interleaved_zb', 'zbv' or 'dualpipev'; "
            r"'gpipe' runs one model chunk",
        ),
        (
            ("1f1b", 4, 8),
            {"virtual_stages": 3},
            ValueError,
            r"virtual_stages=3 needs 'interleaved_1f1b'",
        ),
        (
            ("interleaved_1f1b", 4, 2, 2),
            {},
            ValueError,
            r"interleaved with too few micro-batches: 2 for 4 stages",
        ),
        (
            ("interleaved_1f1b", 4, 6, 2),
            {},
            ValueError,
            r"interleaved needs microbatches to be a multiple of stages, got 6 for 4",
        ),
        (
            ("interleaved_1f1b", 4, 8),
            {},
            ValueError,
            r"'interleaved_1f1b' needs virtual_stages >= 2",
        ),
        (("interleaved_1f1b", 4, 8, 0), {}, ValueError, r"virtual_stages must be >= 1, got 0"),
        (("1f1b", 2.0, 8), {}, TypeError, r"stages must be an int, got 2.0"),
    ],
)
def test_bad_input(args, kwargs, error, message):
    with pytest.raises(error, match="schedule: " + message):
        schedule(*args, **kwargs)


def test_names():
    assert SCHEDULES == ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_h2", "interleaved_zb",
                         "zbv", "dualpipev")
    assert schedule("1f1b", np.int64(2), 2).stages == 2


# -- text and plot ---------------------------------------------------------------------


def test_text_is_an_ascii_gantt():
    assert schedule("1f1b", 2, 2).text() == "\n".join(
        [
            "1f1b: 2 stages, 2 micro-batches, fused backward; 9 ticks, bubble 33.3% "
            "(f=1, b=1, w=1)",
            "tick    0  1  2  3  4  5  6  7  8",
            "stage 0 F0 F1 .  .  B0 W0 .  B1 W1",
            "stage 1 .  F0 B0 W0 F1 B1 W1 .  .",
            "F forward, B input-gradient backward, W weight-gradient backward, . idle",
        ]
    )
    assert "F0.1" in schedule("interleaved_1f1b", 2, 2, 2).text()


def test_repr_and_equality():
    a, b = schedule("gpipe", 2, 3), schedule("gpipe", 2, 3)
    assert a == b and hash(a) == hash(b)
    assert repr(a) == (
        "Schedule('gpipe', stages=2, microbatches=3, virtual_stages=1, split_backward=False, "
        "ticks=12)"
    )
    with pytest.raises(ValueError, match="stage 2 is out of range for 2 stages"):
        a.order(2)


def test_plot_writes_a_gantt_chart(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "1f1b.png"
    fig = schedule("interleaved_1f1b", 2, 4, 2, split_backward=True).plot(path, b=1.5, w=1.5)
    assert path.stat().st_size > 1000
    assert fig.axes[0].get_xlim() == (
        0,
        schedule("interleaved_1f1b", 2, 4, 2, split_backward=True).time(b=1.5, w=1.5),
    )


def test_plot_without_matplotlib_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(
        ImportError,
        match=r"Schedule.plot needs matplotlib, an optional dependency of parallax: pip install",
    ):
        schedule("1f1b", 2, 2).plot()


@pytest.mark.parametrize("module", ["table", "named", "charts", "placement", "zero_bubble",
                                    "timeline"])
def test_docstring_examples_run(module):
    result = doctest.testmod(importlib.import_module(f"parallax.pipeline.schedules.{module}"))
    assert result.failed == 0 and (result.attempted > 0 or module == "zero_bubble")


def test_the_charts_in_the_docs_are_current():
    docs = (pathlib.Path(__file__).parents[3] / "docs" / "pipeline.md").read_text()
    for args, kwargs in [
        (("gpipe", 3, 4), {}),
        (("1f1b", 3, 4), {}),
        (("1f1b", 3, 4), {"split_backward": True}),
        (("interleaved_1f1b", 2, 2, 2), {}),
    ]:
        chart = "\n".join(schedule(*args, **kwargs).text().splitlines()[:-1])  # less the legend
        assert chart in docs, args
