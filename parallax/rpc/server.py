"""A worker's door for calls from the other workers of its machine: a Unix socket.

Each connection is served by a thread of its own, which reads a call, runs it and writes
its answer; a caller uses a connection for one call at a time (``parallax/rpc/direct.py``),
so a call that calls back into this worker arrives on another connection, served by another
thread, and never waits for a free one. A Unix socket lives in a directory only this user
may enter (mode 0700) and is reachable from no network.

An exception raised by the call travels back with its traceback text; an answer that does
not pickle becomes a ``TypeError`` that says so.

References:
  PyTorch's TensorPipe agent: a listener per worker, requests read per pipe and run on the
  agent's threads, the response (or the exception, as a ``RemoteException`` with the
  traceback) written back on the same pipe.
"""

from __future__ import annotations

import os
import socket
import threading
import traceback
from collections.abc import Callable

from parallax.rpc import frames


def failure(error: BaseException) -> tuple:
    """What a failed call answers: ``(exception, traceback text)``, the exception replaced by
    a ``RuntimeError`` naming it where it does not pickle.

    Example:
      >>> try:
      ...     {}["k"]
      ... except KeyError as e:
      ...     error, text = failure(e)
      >>> type(error).__name__, "KeyError" in text
      ('KeyError', True)
    """
    text = "".join(traceback.format_exception(error))
    try:
        frames.encode(frames.FAILURE, error)
        return error, text
    except Exception:
        return RuntimeError(f"{type(error).__qualname__}: {error} (the exception itself does "
                            "not pickle; see the remote traceback)"), text


class Server:
    """Serves ``handle(method, args)`` to connections on the Unix socket ``path``.

    Args:
      path: the socket's path (its directory must exist).
      handle: runs one call; what it returns is the answer.
      describe: this worker, for messages (``"worker 'w1' (rank 1)"``).

    Example:
      >>> import tempfile, os
      >>> from parallax.rpc import frames
      >>> path = os.path.join(tempfile.mkdtemp(), "0.sock")
      >>> server = Server(path, lambda method, args: sum(args), "worker 'w' (rank 0)")
      >>> client = socket.socket(socket.AF_UNIX); client.connect(path)
      >>> frames.send(client, frames.encode(frames.CALL, ("add", (1, 2))))
      >>> frames.receive(client).load()
      3
      >>> client.close(); server.close()
    """

    def __init__(self, path: str, handle: Callable[[str, tuple], object], describe: str):
        self.path, self._handle, self._describe = path, handle, describe
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(path)
        self._listener.listen(128)
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="parallax-rpc-accept").start()

    def close(self) -> None:
        """Stops taking connections and closes the open ones (calls running finish; their
        answers are not written)."""
        with self._lock:
            self._closed = True
            connections, self._connections = list(self._connections), set()
        for sock in [self._listener, *connections]:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:  # closed
                return
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                self._connections.add(sock)
            threading.Thread(target=self._serve, args=(sock,), daemon=True,
                             name="parallax-rpc-call").start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            while self._serve_one(sock):
                pass
        finally:
            with self._lock:
                self._connections.discard(sock)
            sock.close()

    def _serve_one(self, sock: socket.socket) -> bool:
        """One call on ``sock``; whether the connection is still open. (A function of its
        own, so that the call's arguments and answer are freed when it returns: an RRef
        among them releases its count then, not when the next call on the connection
        comes.)"""
        try:
            frame = frames.receive(sock)
        except OSError:  # the caller went away, or this server closed
            return False
        try:
            method, args = frame.load()
            kind, answer = frames.ANSWER, self._handle(method, args)
        except BaseException as error:  # the call's own, or its request's unpickling
            kind, answer = frames.FAILURE, failure(error)
        if frame.kind == frames.ONE_WAY:
            return True
        try:
            pieces = frames.encode(kind, answer)
        except Exception as error:
            pieces = frames.encode(frames.FAILURE, failure(TypeError(
                f"parallax.rpc: the answer of {self._describe} to a call does not pickle "
                f"({type(error).__name__}: {error}); return arrays, pytrees, RRefs or other "
                "picklable values")))
        try:
            frames.send(sock, pieces)
        except OSError:
            return False
        return True
