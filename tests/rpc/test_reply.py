"""A call's answer is read exactly once: by the waiting thread, or by Ray's callback."""

import gc
import threading
import time

import pytest

from parallax.rpc.errors import RPCTimeoutError
from parallax.rpc.future import Future, NotAnsweredYet
from rpc import rpc_testing as t

T = 30


class FakeReply:
    """A reply that counts its reads; ``answer`` is None while the callee has not answered."""

    object_ref = None

    def __init__(self, answer=None):
        self.answer, self.reads, self.later, self.reader = answer, 0, [], None

    def read(self, timeout):
        if self.answer is None:
            time.sleep(timeout or 0)
            raise NotAnsweredYet("fake")
        self.reads += 1
        self.reader = threading.get_ident()
        return self.answer

    def read_later(self, future):
        self.later.append(future)


def test_wait_reads_the_answer_once_in_the_waiting_thread():
    reply = FakeReply(answer=42)
    future = Future(timeout=T, describe="a call", reply=reply)
    assert future.wait() == 42 and future.wait() == 42 and future.done()
    assert reply.reads == 1 and reply.reader == threading.get_ident() and not reply.later


def test_a_callback_before_the_wait_leaves_the_reading_to_ray():
    reply = FakeReply(answer=42)
    future = Future(timeout=T, describe="a call", reply=reply)
    seen = []
    future.add_done_callback(lambda f: seen.append(f.value()))
    assert reply.later == [future]  # Ray's callback is the reader now
    future.set_result(42)  # what that callback does
    assert future.wait() == 42 and seen == [42] and reply.reads == 0


def test_a_wait_that_reaches_the_deadline_fails_and_hands_the_answer_over():
    reply = FakeReply()
    future = Future(timeout=0.05, describe="rpc_sync(f) on worker 'w1' (rank 1)", reply=reply)
    with pytest.raises(RPCTimeoutError, match=r"rpc_sync\(f\) on worker 'w1' \(rank 1\) did not "
                       r"answer within its timeout of 0.05 s"):
        future.wait()
    assert reply.later == [future] and reply.reads == 0  # a late answer is still read, once


@pytest.mark.xdist_group("ray")
@pytest.mark.usefixtures("ray_cluster")
def test_an_rref_in_an_answer_that_came_too_late_is_still_released(group):
    def owned():
        return group.rpc_sync("w1", t.num_owned, timeout=T)

    gc.collect()
    deadline = time.monotonic() + 10
    while owned() != 0:
        assert time.monotonic() < deadline
        gc.collect()
        time.sleep(0.05)
    rref = group.remote("w1", t.ones, args=(4,), timeout=T)
    rref.to_here(T)
    with pytest.raises(group.RPCTimeoutError, match=r"rpc_sync\(sleep_then\) on worker 'w3'"):
        group.rpc_sync("w3", t.sleep_then, args=(0.5, rref), timeout=0.1)  # answers rref late
    time.sleep(0.8)
    gc.collect()
    assert owned() == 1  # the late answer's copy was not counted twice (nor freed twice)
    del rref
    while owned() != 0:  # ... and it was read and freed: nothing leaks
        assert time.monotonic() < deadline + 10, "the late answer's RRef was never released"
        gc.collect()
        time.sleep(0.05)
