"""The papers' bubble: every named schedule against its paper's closed form and PyTorch's order.

The bubble is idle time over every stage's makespan, ``W`` counted as work, each stage running
its order as early as it may (``parallax.pipeline.schedules.timeline``). The closed forms:

* GPipe, 1F1B: ``(p - 1)(T_F + T_B + T_W)`` idle per stage, so ``(p - 1) / (m + p - 1)`` for any
  costs (Narayanan et al. 2021, section 3: ``(p - 1) / m`` of the ideal time).
* interleaved 1F1B: ``(p - 1) / (v m)`` of the ideal time (Narayanan et al. 2021, SC, 2.2.2).
* ZB-H1 and PyTorch's interleaved ZB (ZB-1p): ``(p - 1)(T_F + T_B - T_W)`` per stage (Qi et
  al. 2024, Zero Bubble Pipeline Parallelism, table 2); ZB-H2: ``(p - 1)(T_F + T_B - 2 T_W)``
  with steps overlapping (the paper's parallelogram), 0 at equal costs.
* ZB-V: 0 at equal costs and ``m >= 2p`` with steps overlapping (Qi et al. 2024, section 6);
  DualPipeV: no closed form in parallax's model (DeepSeek-V3's ``(PP/2 - 1)(F&B + B - 3W)``
  counts a forward and a backward overlapped into one unit, see docs/pipeline.md); it is
  checked against PyTorch's published order instead.

PyTorch's orders: ``test/distributed/pipelining/artifacts/dualpipev_4rank_10mb.csv`` and
``zb1p_2rank_2stagep_compute.csv`` (its ``ScheduleDualPipeV`` and
``ScheduleInterleavedZeroBubble``, copied below as data), and ``Schedule1F1B`` /
``ScheduleGPipe`` from ``torch/distributed/pipelining/schedules.py`` (warm-up
``min(m, p - rank)`` forwards, then a full backward and a forward in turn).
"""

import re

import pytest

from parallax.pipeline import Schedule, schedule

NAMED = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zb_h2", 1),
         ("interleaved_zb", 2), ("zbv", 2), ("dualpipev", 2)]
COSTS = [(1, 1, 1), (1, 1, 0.5), (2, 1, 1), (1, 2, 1), (1, 1.5, 0.7), (1, 0.5, 0.5)]
SIZES = [(2, 4), (3, 6), (4, 8), (4, 12), (8, 16)]


def idle_per_stage(s, f, b, w, **kw):
    """Idle time of one stage: the bubble times the makespan (every stage has equal work)."""
    work = s.virtual_stages * s.microbatches * (f + b + w)
    return work / (1 - s.bubble_fraction(f, b, w, **kw)) - work


def test_the_issues_numbers_are_the_papers():
    # schedule(...).bubble_fraction(f=1, b=1, w=1) at p = 4, m = 8 read 0.484, 0.385, 0.360
    # when b was the whole backward and a tick cost its slowest action.
    bubble = {n: schedule(n, 4, 8, v).bubble_fraction(f=1, b=1, w=1) for n, v in NAMED}
    assert bubble["1f1b"] == pytest.approx(3 / 11)          # (p - 1) / (m + p - 1)
    assert bubble["zb_h1"] == pytest.approx(3 / 27)         # a third of 1F1B's idle per stage
    assert idle_per_stage(schedule("zb_h1", 4, 8), 1, 1, 1) == pytest.approx(
        idle_per_stage(schedule("1f1b", 4, 8), 1, 1, 1) / 3)
    for name in ("zbv", "dualpipev"):                       # near 0: the synchronous floor
        assert bubble[name] == pytest.approx(3 / (6 * 8 + 3))
    assert schedule("zbv", 4, 8).bubble_fraction(1, 1, 1, overlap_steps=True) == 0


@pytest.mark.parametrize("f,b,w", COSTS)
@pytest.mark.parametrize("p,m", SIZES)
def test_each_schedule_against_its_papers_closed_form(p, m, f, b, w):
    for name in ("gpipe", "1f1b"):
        assert schedule(name, p, m).bubble_fraction(f, b, w) == pytest.approx((p - 1) / (m + p - 1))
    for v in (2, 3):
        bub = schedule("interleaved_1f1b", p, m, v).bubble_fraction(f, b, w)
        assert bub / (1 - bub) == pytest.approx((p - 1) / (v * m))
    assert idle_per_stage(schedule("zb_h1", p, m), f, b, w) == pytest.approx((p - 1) * (f + b - w))
    assert idle_per_stage(schedule("interleaved_zb", p, m, 2), f, b, w) == pytest.approx(
        (p - 1) * (f + b - w))
    if f + b >= 2 * w:  # the paper's ZB-H2 formula assumes W fits into F + B
        assert idle_per_stage(schedule("zb_h2", p, m), f, b, w, overlap_steps=True) == (
            pytest.approx((p - 1) * (f + b - 2 * w), abs=1e-9))


@pytest.mark.parametrize("p,m", SIZES)
@pytest.mark.parametrize("name", ["zbv", "dualpipev", "zb_h2"])
def test_zero_bubble_schedules_at_equal_costs(name, p, m):
    s = schedule(name, p, m)
    v = s.virtual_stages
    assert s.bubble_fraction() == pytest.approx((p - 1) / (3 * v * m + p - 1))  # the floor
    if name != "dualpipev":
        assert s.bubble_fraction(overlap_steps=True) == pytest.approx(0, abs=1e-12)


@pytest.mark.parametrize("p,m", SIZES)
@pytest.mark.parametrize("name,v", NAMED)
def test_lockstep_agrees_at_equal_costs_and_pays_more_otherwise(name, v, p, m):
    if name == "dualpipev" and m < 2 * p:
        return
    s = schedule(name, p, m, v)
    assert s.bubble_fraction(lockstep=True) == pytest.approx(s.bubble_fraction())
    assert s.makespan() == s.time()
    for f, b, w in COSTS:
        assert s.time(f, b, w) >= s.makespan(f, b, w) - 1e-9


# -- PyTorch's published orders, replayed with the same unit costs ------------------------

DUALPIPEV_4RANK_10MB = """
0F0,0F1,0F2,0F3,0F4,0F5,0F6,7F0,7I0,7W0,7F1,7I1,7W1,7F2,7I2,7W2,7F3,(0F7;7B3)OVERLAP_F_B,(7F4;0B0)OVERLAP_F_B,(0F8;7B4)OVERLAP_F_B,(7F5;0B1)OVERLAP_F_B,(0F9;7B5)OVERLAP_F_B,(7F6;0B2)OVERLAP_F_B,7B6,(7F7;0B3)OVERLAP_F_B,7B7,(7F8;0B4)OVERLAP_F_B,7B8,(7F9;0B5)OVERLAP_F_B,7B9,0I6,0W6,0I7,0W7,0I8,0W8,0I9,0W9
1F0,1F1,1F2,1F3,1F4,6F0,1F5,6F1,6I0,6W0,6F2,6I1,6W1,6F3,(1F6;6B2)OVERLAP_F_B,(6F4;1B0)OVERLAP_F_B,(1F7;6B3)OVERLAP_F_B,(6F5;1B1)OVERLAP_F_B,(1F8;6B4)OVERLAP_F_B,(6F6;1B2)OVERLAP_F_B,(1F9;6B5)OVERLAP_F_B,(6F7;1B3)OVERLAP_F_B,6B6,(6F8;1B4)OVERLAP_F_B,6B7,(6F9;1B5)OVERLAP_F_B,6B8,1B6,6I9,1I7,6W9,1I8,1W7,1I9,1W8,1W9
2F0,2F1,2F2,5F0,2F3,5F1,2F4,5F2,5I0,5W0,5F3,(2F5;5B1)OVERLAP_F_B,(5F4;2B0)OVERLAP_F_B,(2F6;5B2)OVERLAP_F_B,(5F5;2B1)OVERLAP_F_B,(2F7;5B3)OVERLAP_F_B,(5F6;2B2)OVERLAP_F_B,(2F8;5B4)OVERLAP_F_B,(5F7;2B3)OVERLAP_F_B,(2F9;5B5)OVERLAP_F_B,(5F8;2B4)OVERLAP_F_B,5B6,(5F9;2B5)OVERLAP_F_B,5B7,2B6,5B8,2I7,5I9,2I8,2W7,2I9,5W9,2W8,2W9
3F0,4F0,3F1,4F1,3F2,4F2,3F3,4F3,3F4,4B0,(4F4;3B0)OVERLAP_F_B,(3F5;4B1)OVERLAP_F_B,(4F5;3B1)OVERLAP_F_B,(3F6;4B2)OVERLAP_F_B,(4F6;3B2)OVERLAP_F_B,(3F7;4B3)OVERLAP_F_B,(4F7;3B3)OVERLAP_F_B,(3F8;4B4)OVERLAP_F_B,(4F8;3B4)OVERLAP_F_B,(3F9;4B5)OVERLAP_F_B,(4F9;3B5)OVERLAP_F_B,4B6,3B6,4B7,3B7,4I8,3I8,4I9,3I9,4W8,3W8,4W9,3W9
"""
# An older artifact: there "B" is the input-gradient backward (today's "I"); blank is idle.
ZB1P_2RANK_2STAGEP = """
0F0,0F1,2F0,,2F1,2B0,2W0,0F2,2B1,2W1,0F3,0B0,0W0,2F2,0B1,0W1,2F3,2B2,2W2,0F4,2B3,2W3,0F5,0B2,0W2,2F4,0B3,0W3,2F5,2B4,2W4,0F6,2B5,2W5,0F7,0B4,0W4,2F6,0B5,0W5,2F7,2B6,2W6,2B7,2W7,0B6,0W6,0B7,0W7
,1F0,1F1,3F0,3B0,3F1,3B1,3W0,1F2,1B0,3W1,1F3,1B1,1W0,3F2,3B2,1W1,3F3,3B3,3W2,1F4,1B2,3W3,1F5,1B3,1W2,3F4,3B4,1W3,3F5,3B5,3W4,1F6,1B4,3W5,1F7,1B5,1W4,3F6,3B6,1W5,3F7,3B7,3W6,1B6,3W7,1B7,1W6,1W7
"""


def torch_1f1b(p, m):
    """``Schedule1F1B``'s per-rank order: ``min(m, p - rank)`` forwards, then B, F in turn."""
    ranks = []
    for r in range(p):
        warm = min(m, p - r)
        order = [f"{r}F{j}" for j in range(warm)]
        for k in range(m):
            order.append(f"{r}B{k}")
            if warm + k < m:
                order.append(f"{r}F{warm + k}")
        ranks.append(",".join(order))
    return "\n".join(ranks)


def torch_gpipe(p, m):
    """``ScheduleGPipe``'s per-rank order: every forward, then every full backward."""
    return "\n".join(",".join([f"{r}F{j}" for j in range(m)] + [f"{r}B{j}" for j in range(m)])
                     for r in range(p))


def from_torch(text, chunk_of, full_backward="B"):
    """PyTorch's ``{stage}{F|I|B|W}{mb}`` rank orders as parallax orders (B = I then W)."""
    orders = []
    for line in text.split():
        order = []
        for stage, kind, mb in re.findall(r"(\d+)([FIBW])(\d+)", line):
            c = chunk_of(int(stage))
            if kind == full_backward:
                order += [f"B{mb}.{c}", f"W{mb}.{c}"]
            else:
                order.append(f"{'B' if kind == 'I' else kind}{mb}.{c}")
        orders.append(order)
    return orders


@pytest.mark.parametrize("name,p,m,v,text,chunk_of,full", [
    ("dualpipev", 4, 10, 2, DUALPIPEV_4RANK_10MB, lambda st: int(st >= 4), "B"),
    ("interleaved_zb", 2, 8, 2, ZB1P_2RANK_2STAGEP, lambda st: st // 2, None),
    ("1f1b", 4, 8, 1, torch_1f1b(4, 8), lambda st: 0, "B"),
    ("1f1b", 3, 2, 1, torch_1f1b(3, 2), lambda st: 0, "B"),
    ("gpipe", 4, 8, 1, torch_gpipe(4, 8), lambda st: 0, "B"),
])
def test_pytorch_orders_replayed_give_the_same_orders_and_bubble(name, p, m, v, text,
                                                                   chunk_of, full):
    ours = schedule(name, p, m, v)
    orders = from_torch(text, chunk_of, full_backward=full or "-")
    if full is None:  # the old artifact's B is the input gradient
        orders = from_torch(text.replace("B", "I"), chunk_of, full_backward="-")
    theirs = Schedule.from_orders(orders, split_backward=ours.split_backward, microbatches=m,
                                  virtual_stages=v, placement=ours.placement)
    assert [ours.order(s) for s in range(p)] == [theirs.order(s) for s in range(p)]
    for f, b, w in COSTS:
        assert theirs.makespan(f, b, w) == pytest.approx(ours.makespan(f, b, w))
        assert theirs.bubble_fraction(f, b, w) == pytest.approx(ours.bubble_fraction(f, b, w))
