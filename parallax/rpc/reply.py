"""The answer of a call to another worker (a Ray object), read exactly once.

Reading an answer deserializes it, and deserializing is not free of side effects: an RRef
inside an answer becomes a user that, once freed, sends a release to its owner. So each
answer has exactly one reader, whichever comes first:

* ``read(timeout)``, in the caller's own thread (``ray.get``): what ``rpc_sync`` does, as a
  raw ``ray.get`` of an actor call would. No other thread takes part, so the answer is not
  handed from Ray's callback thread to the waiting one (which, on a loaded machine, waits
  up to the interpreter's switch interval for the GIL);
* ``read_later(future)``: Ray's completion callback (``ObjectRef.future()``) reads it and
  completes ``future``: for futures handed to user code (``rpc_async``), and for an answer
  its waiter gave up on (timed out, interrupted), so that it is still read, and released.

Both map Ray's failures to this package's the same way: a dead actor is
:class:`RemoteWorkerError` naming the worker, an exception raised by the function is
re-raised as itself, chained from its remote traceback (:func:`parallax.rpc.errors.raised_on`).

Used for workers reached through Ray (:class:`parallax.rpc.peers.RayPeer`): those of another
machine, or all of them when the group's ``_transports`` is ``["ray"]``.

References:
  Ray, ``ray.get`` and ``ObjectRef.future()`` (its callback deserializes the object);
  PyTorch's TensorPipe agent completes a call's future once, from the response handler.
"""

from __future__ import annotations

import re

import ray

from parallax.rpc.errors import RemoteWorkerError, raised_on
from parallax.rpc.future import NotAnsweredYet

ANSI_COLOUR = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours the worker's name in its messages


class Reply:
    """The pending answer of one call.

    Args:
      object_ref: the Ray object the callee's answer will be.
      worker: the callee's name.
      rank: the callee's rank.
      describe: the call's name in error messages.

    Example:
      >>> import parallax.rpc as rpc
      >>> rpc.init_rpc("solo")
      >>> reply = Reply(ray.put(41), "solo", 0, "a call")
      >>> reply.read(timeout=5) + 1
      42
      >>> rpc.shutdown()
    """

    __slots__ = ("object_ref", "worker", "rank", "describe")

    def __init__(self, object_ref, worker: str, rank: int, describe: str):
        self.object_ref, self.worker, self.rank, self.describe = object_ref, worker, rank, describe

    def read(self, timeout: float | None):
        """The answer, read in this thread (``None``: wait as long as it takes).

        Raises:
          NotAnsweredYet: ``timeout`` passed first.
          RemoteWorkerError: the callee died; or the function's own exception.
        """
        try:
            return ray.get(self.object_ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise NotAnsweredYet(self.describe) from None
        except ray.exceptions.RayError as error:
            failure = self.failure(error)
            raise failure from failure.__cause__  # the remote traceback, not Ray's wrapper

    def read_later(self, future) -> None:
        """Completes ``future`` (a :class:`parallax.rpc.Future`) from Ray's callback thread."""
        self.object_ref.future().add_done_callback(lambda done: self._settle(future, done))

    def _settle(self, future, done) -> None:
        try:
            future.set_result(done.result())
        except BaseException as error:
            future.set_exception(self.failure(error))

    def failure(self, error: BaseException) -> BaseException:
        """The error a caller sees for Ray's ``error``."""
        if isinstance(error, ray.exceptions.RayActorError):
            return RemoteWorkerError(
                f"parallax.rpc: worker {self.worker!r} (rank {self.rank}) died before "
                f"answering {self.describe}: its process is gone, and with it the values of the "
                "RRefs it owned; restart the RPC group (shutdown, init_rpc)")
        if isinstance(error, ray.exceptions.RayTaskError):
            # Ray's "dual" RayTaskError(ValueError) keeps no traceback_str: its text is str()
            text = vars(error).get("traceback_str") or ANSI_COLOUR.sub("", str(error))
            return raised_on(error.cause, self.worker, self.rank, text)
        return error
