"""The zero-bubble and V schedules: validity, bubble and memory against the papers, placement.

Costs ``F = B = W = 1`` (``f=1, b=1, w=1``). In a synchronous step (parallax's: the step
ends with the optimizer update) no schedule beats ``(p - 1) / (3 v m + p - 1)``: the last
stage cannot start before tick ``p - 1``. The zero-bubble paper's "zero" counts each stage
from its own first action (``overlap_steps=True``), as its post-validated optimizer step
lets consecutive steps overlap.
"""

import re

import pytest

from parallax.pipeline import Placement, Schedule, schedule

SIZES = [(p, f * p) for p in (2, 4) for f in (1, 2, 4)]
NEW = ("zb_h1", "zb_h2", "interleaved_zb", "zbv", "dualpipev")


def build(name, p, m):
    return schedule(name, p, m, 2 if name == "interleaved_zb" else None)


def floor(p, m, v=1):
    """The least bubble of a synchronous step: the last stage waits p - 1 ticks."""
    return (p - 1) / (3 * v * m + p - 1)


@pytest.mark.parametrize("p,m", SIZES)
@pytest.mark.parametrize("name", NEW)
def test_every_new_schedule_validates_and_splits_the_backward(name, p, m):
    if name == "dualpipev" and m < 2 * p:
        with pytest.raises(ValueError, match=re.escape(
                f"schedule: 'dualpipev' needs at least 2 * stages = {2 * p} micro-batches")):
            build(name, p, m)
        return
    s = build(name, p, m)
    assert s.split_backward and s.validate() is None
    assert s.placement.name == ("v" if name in ("zbv", "dualpipev") else "looped")
    assert s == Schedule.from_orders([s.order(k) for k in range(p)], split_backward=True,
                                     placement=s.placement, name=name)


@pytest.mark.parametrize("p,m", SIZES)
def test_zb_h1_pays_the_papers_bubble_at_1f1bs_memory(p, m):
    zb, one = build("zb_h1", p, m), schedule("1f1b", p, m)
    # (p - 1)(F + B - W) per stage: the step is 3m + p - 1 ticks
    assert zb.ticks == 3 * m + p - 1
    assert zb.bubble_fraction(1, 1, 1) == pytest.approx(floor(p, m), abs=1e-12)
    assert zb.bubble_fraction(1, 1, 1) < one.bubble_fraction(1, 1, 1) / 2  # about a third
    # every stage holds p micro-batches (1F1B's first stage); full activations as 1F1B
    assert [zb.peak_in_flight(s) for s in range(p)] == [min(p, m)] * p
    assert [zb.peak_in_flight(s, "B") for s in range(p)] == [
        one.peak_in_flight(s) for s in range(p)]


@pytest.mark.parametrize("p,m", SIZES)
def test_zb_h2_has_no_bubble_once_steps_overlap(p, m):
    zb = build("zb_h2", p, m)
    if m >= 2 * p:
        assert zb.bubble_fraction(1, 1, 1) == pytest.approx(floor(p, m), abs=1e-12)
        assert zb.bubble_fraction(1, 1, 1, overlap_steps=True) == 0  # the parallelogram
        # the paper's 2p - 1 micro-batches of full activations (2p counting pending W)
        assert zb.peak_in_flight(0, "B") == 2 * p - 1 and zb.peak_in_flight(0) == 2 * p
    assert zb.bubble_fraction(1, 1, 1) <= build("zb_h1", p, m).bubble_fraction(1, 1, 1) + 0.06


@pytest.mark.parametrize("p,m", SIZES)
def test_interleaved_zero_bubble_reaches_the_synchronous_floor(p, m):
    s = build("interleaved_zb", p, m)
    assert s.bubble_fraction(1, 1, 1) == pytest.approx(floor(p, m, 2), abs=1e-12)
    if (p, m) == (4, 8):  # the measurement of PyTorch's order: 5.9 %
        assert round(100 * s.bubble_fraction(1, 1, 1), 1) == 5.9


@pytest.mark.parametrize("p,m", SIZES)
@pytest.mark.parametrize("name", ["zbv", "dualpipev"])
def test_v_schedules(name, p, m):
    if m < 2 * p:
        return  # DualPipeV needs 2p micro-batches; ZB-V runs, with its warm-up unfilled
    s = build(name, p, m)
    assert s.bubble_fraction(1, 1, 1) == pytest.approx(floor(p, m, 2), abs=1e-12)
    peaks = [s.peak_in_flight(k) for k in range(p)]  # in chunks, each half a stage
    if name == "zbv":
        assert s.bubble_fraction(1, 1, 1, overlap_steps=True) == 0
        assert peaks == [2 * p] * p  # 1F1B's p stage activations, on every stage
    else:
        assert peaks == [2 * p + 1] * p


def test_v_placement_runs_the_turn_locally_and_ends_on_the_first_stage():
    s = schedule("zbv", 2, 4)
    assert s.placement == Placement.v(2) and s.placement.location(3) == (0, 1)
    assert s.placement.direction(1, 2) == "local"  # virtual 1 and 2 are both on stage 1
    assert "V-shaped placement" in s.text().splitlines()[0]


def test_placements_are_checked():
    with pytest.raises(ValueError, match=r"placement: the virtual stages .* must be a "
                                         r"permutation of 0\.\.3"):
        Placement("custom", ((0, 1), (1, 2)))
    with pytest.raises(ValueError, match=r"placement: virtual stages 0 and 1 are on stages "
                                         r"0 and 2, which are not neighbours"):
        Placement("custom", ((0, 3), (4, 5), (1, 2), (6, 7)))
    with pytest.raises(ValueError, match=r"the V placement holds 2 chunks per stage, got "
                                         r"virtual_stages=3"):
        Placement.named("v", 2, 3)
    with pytest.raises(ValueError, match=r"schedule: 'zbv' runs 2 model chunks per stage in "
                                         r"the V placement, got virtual_stages=3"):
        schedule("zbv", 2, 4, 3)
    with pytest.raises(ValueError, match=r"schedule: 'zb_h1' moves weight gradients away "
                                         r"from their input gradients, so it needs "
                                         r"split_backward=True"):
        schedule("zb_h1", 2, 4, split_backward=False)
    with pytest.raises(ValueError, match=r"'interleaved_zb' runs micro-batches in 2 rounds"):
        schedule("interleaved_zb", 4, 9, 2)


def test_charts_draw_the_v(tmp_path):
    pytest.importorskip("matplotlib")
    fig = schedule("dualpipev", 2, 4).plot(tmp_path / "v.png")
    assert "V-shaped placement" in fig.axes[0].get_title()
    assert (tmp_path / "v.png").stat().st_size > 1000
