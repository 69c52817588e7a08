"""Two helper threads of an agent: one reads the answers nobody waits for, one sends
one-way messages.

* :class:`AnswerReader`: an ``rpc_async`` call sends its request from the caller's thread
  and returns; the answer arrives later on that call's connection. One thread watches all
  such connections (``selectors``) and, when one is readable, reads the answer and hands it
  to the call's callback (which completes the future). An ``rpc_sync`` that gave up waiting
  (timeout) leaves its connection here too, so that the late answer is still read, once
  (an RRef in it is counted, then released), and the connection reused.
* :class:`Outbox`: RRef and context releases are one-way messages sent when Python frees an
  object (``__del__``, any thread, possibly inside a lock); they are queued
  (``queue.SimpleQueue.put`` is safe there) and sent by one thread.

References:
  PyTorch's TensorPipe agent: responses are read by the pipe's callbacks and complete the
  call's future; RRef deletes (``RRefUserDelete``) are fire-and-forget messages.
"""

from __future__ import annotations

import queue
import selectors
import socket
import threading
from collections.abc import Callable

from parallax.rpc.frames import Frame, receive


class AnswerReader:
    """Reads answers on watched connections from one thread, started on first use.

    Example:
      >>> a, b = socket.socketpair()
      >>> got = []
      >>> reader = AnswerReader()
      >>> from parallax.rpc import frames
      >>> reader.watch(a, got.append)
      >>> frames.send(b, frames.encode(frames.ANSWER, 42))
      >>> import time; time.sleep(0.5); got[0].load()
      42
      >>> reader.close()
    """

    def __init__(self):
        self._selector = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._wake_read, self._wake_write = socket.socketpair()
        self._selector.register(self._wake_read, selectors.EVENT_READ, None)
        self._thread: threading.Thread | None = None
        self._closed = False

    def watch(self, sock: socket.socket, on_answer: Callable[[Frame | BaseException], None]):
        """Calls ``on_answer(frame)`` once ``sock``'s answer is read (``on_answer(error)``
        if the connection broke, or the reader closed first)."""
        with self._lock:
            if self._closed:
                closed = True
            else:
                closed = False
                self._selector.register(sock, selectors.EVENT_READ, on_answer)
                if self._thread is None:
                    self._thread = threading.Thread(target=self._serve, daemon=True,
                                                    name="parallax-rpc-answers")
                    self._thread.start()
        if closed:
            on_answer(ConnectionAbortedError("the RPC agent was shut down"))

    def close(self) -> None:
        """Stops the thread; callbacks still waiting get a ``ConnectionAbortedError``."""
        with self._lock:
            self._closed = True
            waiting = [key for key in self._selector.get_map().values() if key.data is not None]
            for key in waiting:
                self._selector.unregister(key.fileobj)
        self._wake_write.send(b"x")
        for key in waiting:
            key.data(ConnectionAbortedError("the RPC agent was shut down"))

    def _serve(self) -> None:
        while self._read_ready():
            pass

    def _read_ready(self) -> bool:
        """Reads the answers that have arrived; False once closed. (A function of its own:
        nothing of an answer outlives it, so an RRef in an answer nobody kept is released.)"""
        for key, _ in self._selector.select():
            if key.data is None:  # woken by close()
                self._selector.close()
                self._wake_read.close()
                self._wake_write.close()
                return False
            with self._lock:
                if self._closed:
                    continue
                self._selector.unregister(key.fileobj)
            try:
                answer = receive(key.fileobj)
            except OSError as error:  # the callee died, or closed the connection
                answer = error
            key.data(answer)
        return True


class Outbox:
    """Sends one-way messages in order, from one thread started on first use.

    Example:
      >>> sent = []
      >>> outbox = Outbox()
      >>> outbox.put(sent.append, "release r1")
      >>> outbox.close(); sent
      ['release r1']
    """

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start = threading.Lock()

    def put(self, send: Callable, *args) -> None:
        """Queues ``send(*args)`` (safe in ``__del__``: never blocks, takes no lock of ours
        once the thread runs)."""
        self._queue.put((send, args))
        if self._thread is None:
            with self._start:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._serve, daemon=True,
                                                    name="parallax-rpc-outbox")
                    self._thread.start()

    def close(self) -> None:
        """Sends what is queued, then stops the thread."""
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            send, args = item
            try:
                send(*args)
            except Exception:  # the receiver is gone: nothing left to release there
                pass
