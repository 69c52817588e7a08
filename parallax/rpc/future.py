"""``Future``: the result of an asynchronous call, with ``wait``, ``then``, ``collect_all``.

A thin layer over :class:`concurrent.futures.Future` with PyTorch's method names and a
deadline: a future made with ``timeout`` completes with :class:`RPCTimeoutError` once it has
waited that long, whether or not anyone is waiting on it.

A future may also carry its call's unread answer (a :class:`parallax.rpc.reply.Reply`, given
by ``Agent.call_and_wait``, which waits at once): then ``wait()`` reads the answer in the
waiting thread itself, and only if something else needs the future first (a callback,
``done()``) or the wait gives up is the answer read by Ray's callback thread instead. Either
way it is read once.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from parallax.rpc.errors import RPCTimeoutError


def expired_error(describe: str, timeout: float) -> RPCTimeoutError:
    """The error of a call that passed its deadline.

    Example:
      >>> str(expired_error("rpc_sync(f) on worker 'w1' (rank 1)", 0.5))[:64]
      "parallax.rpc: rpc_sync(f) on worker 'w1' (rank 1) did not answer"
    """
    return RPCTimeoutError(
        f"parallax.rpc: {describe} did not answer within its timeout of {timeout} s; pass a "
        "larger timeout= (0 waits forever) or look at the callee")


class NotAnsweredYet(Exception):
    """Raised by a reply's ``read(timeout)`` when the time passed before the answer came (the
    call may still answer): what a :class:`Future`'s reply says instead of a value."""


class Future:
    """A value that a call will produce: ``wait()`` for it, or chain work with ``then``.

    Args:
      timeout: seconds after which the future fails with :class:`RPCTimeoutError`; None or
        0 waits forever.
      describe: the call's name in error messages.
      deadlines: a :class:`parallax.rpc.deadlines.Deadlines` that expires it (an agent's,
        shared by its calls); without one, a timer thread of its own.
      reply: the call's unread answer (:class:`parallax.rpc.reply.Reply`), read by the
        first ``wait()``; its maker must wait at once (until then, the deadline is only
        that wait's limit: no watcher entry or timer is made unless something else needs
        the future first).

    Example:
      >>> f = Future()
      >>> g = f.then(lambda done: done.wait() + 1)
      >>> f.set_result(41)
      >>> g.wait(timeout=5)
      42

    References:
      PyTorch, ``torch.futures.Future`` (``wait``, ``then``, ``done``, ``value``,
      ``set_result``, ``add_done_callback``).
    """

    def __init__(self, *, timeout: float | None = None, describe: str = "the call",
                 deadlines=None, reply=None):
        self._inner: concurrent.futures.Future = concurrent.futures.Future()
        self._describe = describe
        self.object_ref = None  # the Ray object of a remote call, when there is one
        self._reply = reply
        if reply is not None:  # read by wait(): the deadline is its limit (see _watch)
            self.object_ref = reply.object_ref
            self._reply_lock = threading.Lock()
            self._timeout, self._deadlines = timeout, deadlines
            self._deadline = time.monotonic() + timeout if timeout else None
        else:
            self._start_deadline(timeout, deadlines)

    def _start_deadline(self, timeout: float | None, deadlines) -> None:
        if timeout and deadlines is not None:  # an agent's shared watcher (no thread per call)
            this = weakref.ref(self)  # a future nobody holds is not kept until its deadline
            deadlines.add(timeout, lambda: (f := this()) is not None and f._expire(timeout))
        elif timeout:
            timer = threading.Timer(timeout, self._expire, args=(timeout,))
            timer.daemon = True
            timer.start()
            self._inner.add_done_callback(lambda _: timer.cancel())

    def _expire(self, timeout: float) -> None:
        self.set_exception(expired_error(self._describe, timeout))

    def _take_reply(self):
        """The unread answer, now this caller's to read (None if another reader has it)."""
        if self._reply is None:
            return None
        with self._reply_lock:
            reply, self._reply = self._reply, None
        return reply

    def _watch(self) -> None:
        """From here on the future completes by itself (see ``_hand_over``)."""
        reply = self._take_reply()
        if reply is not None:
            self._hand_over(reply)

    def _hand_over(self, reply) -> None:
        """Ray's callback reads the answer; the deadline gets its watcher entry (or timer)."""
        if self._deadline is not None and not self._inner.done():
            self._start_deadline(max(self._deadline - time.monotonic(), 1e-6), self._deadlines)
        reply.read_later(self)  # a late answer is still read once (and its RRefs released)

    def _read(self, reply, timeout: float | None) -> None:
        """Reads the answer in this thread, waiting ``timeout`` at most, within the deadline."""
        left = None if self._deadline is None else max(self._deadline - time.monotonic(), 0.0)
        limit = left if timeout is None else timeout if left is None else min(left, timeout)
        try:
            self.set_result(reply.read(limit))
        except NotAnsweredYet:
            if left is not None and limit >= left:
                self._expire(self._timeout)
            self._hand_over(reply)
        except Exception as error:  # the call's error (Reply.read mapped Ray's)
            self.set_exception(error)
        except BaseException:  # interrupted (KeyboardInterrupt): Ray's callback reads it
            self._hand_over(reply)
            raise

    def wait(self, timeout: float | None = None) -> Any:
        """The value (blocking until there is one); raises the call's error instead if it failed.

        Args:
          timeout: seconds to wait here at most (the call's own deadline applies anyway).
        """
        wait_here = timeout
        if self._reply is not None:
            reply = self._take_reply()
            if reply is not None:
                self._read(reply, timeout)
                wait_here = 0  # the answer was read, or this wait's time is up
        try:
            return self._inner.result(wait_here)
        except concurrent.futures.TimeoutError:  # also the call's own RPCTimeoutError (3.11+)
            if self._inner.done():
                raise
            raise RPCTimeoutError(f"parallax.rpc: waited {timeout} s on {self._describe}, "
                                  "which has not answered yet") from None

    def value(self) -> Any:
        """The value of a completed future (raises its error if it failed)."""
        if not self.done():
            raise ValueError(f"parallax.rpc: Future.value() on {self._describe}, which has not "
                             "completed; call wait() instead")
        return self._inner.result()

    def done(self) -> bool:
        """Whether the future has a value or an error."""
        if self._reply is not None:  # asked before any wait: completes by itself from now on
            self._watch()
        return self._inner.done()

    def set_result(self, value: Any) -> None:
        """Completes the future with ``value`` (ignored if it already completed)."""
        try:
            self._inner.set_result(value)
        except concurrent.futures.InvalidStateError:
            pass

    def set_exception(self, error: BaseException) -> None:
        """Completes the future with ``error`` (ignored if it already completed)."""
        try:
            self._inner.set_exception(error)
        except concurrent.futures.InvalidStateError:
            pass

    def add_done_callback(self, callback: Callable[[Future], None]) -> None:
        """Calls ``callback(self)`` once the future completes (at once if it has)."""
        if self._reply is not None:  # someone other than its waiter needs it: complete by itself
            self._watch()
        self._on_settled(callback)

    def _on_settled(self, callback: Callable[[Future], None]) -> None:
        """``add_done_callback`` that leaves the reading of an answer to ``wait()``: for the
        package's own bookkeeping (pending calls, the call log), which must not move it."""
        self._inner.add_done_callback(lambda _: callback(self))

    def then(self, callback: Callable[[Future], Any]) -> Future:
        """A new future holding ``callback(self)`` once this one completes.

        Args:
          callback: takes this (completed) future; what it returns, or raises, completes
            the new one.
        """
        chained = Future(describe=f"then() of {self._describe}")

        def run(done: Future) -> None:
            try:
                chained.set_result(callback(done))
            except BaseException as error:  # the new future carries it, as PyTorch's does
                chained.set_exception(error)

        self.add_done_callback(run)
        return chained


def collect_all(futures: Sequence[Future]) -> Future:
    """One future that completes, with the list of ``futures``, when all of them have.

    Example:
      >>> a, b = Future(), Future()
      >>> both = collect_all([a, b])
      >>> a.set_result(1); b.set_result(2)
      >>> [f.value() for f in both.wait(timeout=5)]
      [1, 2]

    References:
      PyTorch, ``torch.futures.collect_all``.
    """
    futures = list(futures)
    together = Future(describe=f"collect_all of {len(futures)} futures")
    remaining = [len(futures)]
    lock = threading.Lock()

    def one_done(_: Future) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            together.set_result(futures)

    if not futures:
        together.set_result([])
    for future in futures:
        future.add_done_callback(one_done)
    return together


def wait_all(futures: Sequence[Future], timeout: float | None = None) -> list:
    """The values of ``futures``, in order; raises the first error among them.

    Example:
      >>> a = Future(); a.set_result(3)
      >>> wait_all([a])
      [3]

    References:
      PyTorch, ``torch.futures.wait_all``.
    """
    return [future.wait(timeout) for future in futures]
