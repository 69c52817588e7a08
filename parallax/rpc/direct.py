"""Calls to a worker of the same machine, straight over its Unix socket (no Ray on the way).

A caller keeps a few idle connections per worker and takes one per call, so a connection
carries one call at a time and its next message is that call's answer:

* ``call_and_wait`` (``rpc_sync``, ``to_here``, ...) sends and reads the answer in the
  calling thread, waiting at most until the call's deadline; a call that times out leaves
  its connection to the :class:`parallax.rpc.answers.AnswerReader`, which reads the late
  answer once (its RRefs are counted, then released) and puts the connection back;
* ``call`` (``rpc_async``, ``remote``) sends from the calling thread and leaves the
  connection to the answer reader, which completes the future.

A connection that breaks (the worker's process died) fails its call at once with
:class:`parallax.rpc.RemoteWorkerError`, naming the worker.

Arrays go out of band (``parallax/rpc/frames.py``): a 1 MB array is written from its own
memory and read into one buffer, against Ray's copy into and out of its object store.

References:
  PyTorch's TensorPipe agent (a pipe per peer, the shared-memory transport between
  processes of one machine); PEP 574 (out-of-band buffers).
"""

from __future__ import annotations

import select
import socket
import threading
import time

from parallax.rpc import frames
from parallax.rpc.errors import RemoteWorkerError, raised_on, unpicklable_error
from parallax.rpc.future import Future, expired_error

IDLE_CONNECTIONS = 8  # kept per worker; more are opened while more calls are in flight


def _readable(sock: socket.socket, seconds: float) -> bool:
    """Whether ``sock`` has data (or broke) within ``seconds``."""
    if hasattr(select, "poll"):  # no FD_SETSIZE limit
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        return bool(poller.poll(seconds * 1000))
    return bool(select.select([sock], [], [], seconds)[0])


class DirectPeer:
    """Another worker of this machine, reached on its socket ``path``.

    Args:
      name: the worker's name.
      rank: its rank.
      path: its socket.
      answers: this agent's :class:`parallax.rpc.answers.AnswerReader`.
    """

    def __init__(self, name: str, rank: int, path: str, answers):
        self.name, self.rank, self.path, self._answers = name, rank, path, answers
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._one_way: socket.socket | None = None  # the outbox thread's own connection

    def _dead(self, describe: str) -> RemoteWorkerError:
        return RemoteWorkerError(
            f"parallax.rpc: worker {self.name!r} (rank {self.rank}) died before answering "
            f"{describe}: its process is gone, and with it the values of the RRefs it owned; "
            "restart the RPC group (shutdown, init_rpc)")

    def _connect(self, describe: str) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.path)
        except OSError:
            sock.close()
            raise self._dead(describe) from None
        return sock

    def _take(self, describe: str) -> socket.socket:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return self._connect(describe)

    def _give_back(self, sock: socket.socket) -> None:
        with self._lock:
            if len(self._idle) < IDLE_CONNECTIONS:
                self._idle.append(sock)
                return
        sock.close()

    def _answer(self, answer, sock: socket.socket, describe: str):
        """The value of one answer (raises the call's error); the connection goes back."""
        if isinstance(answer, BaseException):  # read by the answer reader: it broke
            sock.close()
            if isinstance(answer, ConnectionAbortedError):
                raise RuntimeError(f"parallax.rpc: RPC was shut down in this process before "
                                   f"{describe} answered") from None
            raise self._dead(describe) from None
        self._give_back(sock)
        if answer.kind == frames.FAILURE:
            error, text = answer.load()
            raise raised_on(error, self.name, self.rank, text)
        return answer.load()

    def _send(self, method: str, args: tuple, describe: str) -> socket.socket:
        try:
            pieces = frames.encode(frames.CALL, (method, args))
        except RuntimeError:  # an RRef argument's fork failed (its owner died, timed out)
            raise
        except Exception as error:  # nothing was sent
            raise unpicklable_error(describe, error) from None
        sock = self._take(describe)
        try:
            frames.send(sock, pieces)
        except OSError:
            sock.close()
            raise self._dead(describe) from None
        return sock

    def call_and_wait(self, method: str, args: tuple, timeout: float | None, describe: str):
        """Runs ``WorkerState.<method>(*args)`` there; its value, read in this thread."""
        deadline = None if timeout is None else time.monotonic() + timeout
        sock = self._send(method, args, describe)
        if deadline is not None:
            if not _readable(sock, max(deadline - time.monotonic(), 0.0)):
                self._answers.watch(sock, lambda late: self._late(late, sock))
                raise expired_error(describe, timeout)
        try:
            answer = frames.receive(sock)
        except OSError as error:
            answer = error
        return self._answer(answer, sock, describe)

    def _late(self, answer, sock: socket.socket) -> None:
        try:
            self._answer(answer, sock, "a call that timed out")
        except BaseException:  # the caller has given up on it
            pass

    def call(self, method: str, args: tuple, future: Future, describe: str) -> None:
        """Sends the call; ``future`` completes when the answer arrives."""
        sock = self._send(method, args, describe)

        def settle(answer) -> None:
            try:
                future.set_result(self._answer(answer, sock, describe))
            except BaseException as error:
                future.set_exception(error)

        self._answers.watch(sock, settle)

    def send_one_way(self, method: str, args: tuple) -> None:
        """Sends a message nobody answers (from the outbox thread only)."""
        if self._one_way is None:
            self._one_way = self._connect("a one-way message")
        try:
            frames.send(self._one_way, frames.encode(frames.ONE_WAY, (method, args)))
        except OSError:
            self._one_way.close()
            self._one_way = None
            raise

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for sock in idle + ([self._one_way] if self._one_way is not None else []):
            sock.close()
