"""What a runtime reads from a schedule: replaying the arrays finds every value where it is read."""

import numpy as np
import pytest

from parallax.pipeline import schedule
from parallax.pipeline.schedules.action import KIND_CODES
from parallax.pipeline.schedules.slots import schedule_arrays

SCHEDULES = [
    schedule(*args, **kwargs)
    for args, kwargs in [
        (("gpipe", 3, 5), {}), (("1f1b", 4, 8), {}), (("1f1b", 3, 5), {"split_backward": True}),
        (("1f1b", 1, 3), {}), (("interleaved_1f1b", 2, 4, 3), {}),
        (("interleaved_1f1b", 4, 8, 2), {"split_backward": True}), (("zb_h1", 4, 8), {}),
        (("zb_h2", 3, 6), {}), (("interleaved_zb", 2, 4, 2), {}), (("zbv", 4, 8), {}),
        (("zbv", 2, 3), {}), (("dualpipev", 4, 8), {}), (("dualpipev", 2, 5), {}),
    ]
]


def replay(sched, local_seeds=False):
    """Runs the arrays as a runtime would: stores arrivals, checks every read, frees slots."""
    arr = schedule_arrays(sched, local_seeds=local_seeds)
    T, S = sched.ticks, sched.stages
    place = sched.placement
    last = place.count - 1
    stash, inbox = {}, {}  # (stage, slot) -> (micro-batch, chunk, kind of value)
    sent = {}  # tick -> {stage: value}
    for t in range(T):
        for s in range(S):
            arrivals = {
                "up": sent.get(t - 1, {}).get((s - 1) % S, (None, None)),
                "down": sent.get(t - 1, {}).get((s + 1) % S, (None, None)),
                "local": sent.get(t - 1, {}).get(s, (None, None)),
            }
            for channel, slots in (("up", arr.arrive_up), ("down", arr.arrive_down),
                                   ("local", arr.arrive_local)):
                slot = slots[t, s]
                if slot >= 0:
                    value, to = arrivals[channel]
                    assert to == (s, channel), (t, s, channel, value, to)
                    assert (s, slot) not in inbox and 0 <= slot < arr.inbox_capacity[s]
                    inbox[(s, slot)] = value
        sent[t] = {}
        for s in range(S):
            k, m, c = int(arr.kind[t, s]), int(arr.microbatch[t, s]), int(arr.chunk[t, s])
            if k == 0:
                continue
            virtual = place.virtual_stage(s, c)
            slot, inp = int(arr.stash[t, s]), int(arr.input[t, s])
            assert 0 <= slot < arr.stash_capacity[s]
            if k == KIND_CODES["F"]:
                assert (s, slot) not in stash
                stash[(s, slot)] = (m, c)
                if virtual == 0:
                    assert inp == -1
                else:
                    assert inbox.pop((s, inp)) == (m, c, "activation")
                target = virtual + 1 if virtual < last else (virtual + 1 if local_seeds else None)
                if target is not None and target <= last:
                    dest, dest_chunk = place.location(target)
                    channel = place.direction(virtual, target)
                    sent[t][s] = ((m, dest_chunk, "activation"), (dest, channel))
                elif target is not None:  # the seed, to this stage's own B
                    sent[t][s] = ((m, c, "gradient"), (s, "local"))
            elif k == KIND_CODES["B"]:
                assert stash[(s, slot)] == (m, c)
                if virtual == last and not local_seeds:
                    assert inp == -1
                else:
                    assert inbox.pop((s, inp)) == (m, c, "gradient")
                if virtual > 0:
                    dest, dest_chunk = place.location(virtual - 1)
                    sent[t][s] = ((m, dest_chunk, "gradient"),
                                  (dest, place.direction(virtual, virtual - 1)))
            else:
                assert inp == -1 and stash.pop((s, slot)) == (m, c)
    assert not stash and not inbox
    assert list(arr.stash_capacity) == [sched.peak_in_flight(s) for s in range(S)]


@pytest.mark.parametrize("sched", SCHEDULES, ids=repr)
def test_as_arrays_is_a_runnable_buffer_plan(sched):
    arr = sched.as_arrays()
    T, S = sched.ticks, sched.stages
    assert arr.kind.shape == arr.microbatch.shape == (T, S) and arr.kind.dtype == np.int32
    for t, row in enumerate(sched.table):
        for s, a in enumerate(row):
            expected = (0, -1, -1) if a is None else (KIND_CODES[a.kind], *a[1:])
            assert (arr.kind[t, s], arr.microbatch[t, s], arr.chunk[t, s]) == expected
    replay(sched)


@pytest.mark.parametrize("sched", SCHEDULES[:1] + SCHEDULES[-4:], ids=repr)
def test_the_runtimes_seeds_come_through_the_inbox(sched):
    replay(sched, local_seeds=True)


def test_the_v_placement_turns_on_the_last_stage_and_returns_to_the_first():
    arr = schedule("zbv", 4, 8).as_arrays()
    # the turn (virtual 3 -> 4) stays on stage 3; nothing ever arrives on stage 0 from
    # "below" (stage 3) in the V: the first chunk goes up, the second comes back down
    assert (arr.arrive_local[:, 3] >= 0).sum() == 16 and (arr.arrive_local[:, :3] < 0).all()
    assert (arr.arrive_up[:, 0] < 0).all() and (arr.arrive_down[:, 3] < 0).all()
