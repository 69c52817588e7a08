"""The errors a caller of ``parallax.rpc`` sees, as PyTorch users catch them.

PyTorch raises ``RuntimeError`` for RPC's own failures (a dead peer, a timeout, an unknown
worker), and re-raises a function's exception on the caller as the same type with a message
that starts "On WorkerInfo(...)" and holds the remote traceback. Here the caller gets the
function's exception itself (its type, arguments and attributes: ``except ValueError``
works), chained from a :class:`RemoteTraceback` that names the worker and its rank and holds
the remote traceback text; Python prints both.

References:
  PyTorch, ``torch/distributed/rpc/internal.py`` (``RemoteException``, ``_run_function``,
  ``_handle_exception``); ``concurrent.futures.process`` (``_RemoteTraceback`` as the
  ``__cause__`` of a re-raised exception).
"""

from __future__ import annotations


class RemoteWorkerError(RuntimeError):
    """The worker a call was sent to died (its process is gone) before it answered.

    Example:
      >>> str(RemoteWorkerError("worker 'ps' (rank 1) died"))
      "worker 'ps' (rank 1) died"

    References:
      PyTorch, ``torch.distributed.rpc``: a future of a call to a failed peer completes with
      an error naming it (TensorPipe agent, ``handleError``).
    """


class RPCTimeoutError(RuntimeError, TimeoutError):
    """A call did not answer within its ``timeout`` seconds (a ``RuntimeError``, as PyTorch
    raises, and a ``TimeoutError``).

    Example:
      >>> isinstance(RPCTimeoutError("late"), RuntimeError), isinstance(
      ...     RPCTimeoutError("late"), TimeoutError)
      (True, True)

    References:
      PyTorch, ``torch.distributed.rpc.rpc_async(..., timeout=)``: the future raises a
      ``RuntimeError`` once the deadline passes.
    """


class UnknownWorkerError(ValueError, RuntimeError):
    """A call named a worker that is not in the group (a ``RuntimeError``, as PyTorch raises,
    and a ``ValueError``: a wrong value).

    Example:
      >>> isinstance(UnknownWorkerError("w9"), RuntimeError)
      True

    References:
      PyTorch, ``TensorPipeAgent::getWorkerInfo``: "Unknown destination worker".
    """


def unpicklable_error(describe: str, error: BaseException) -> TypeError:
    """The error of a call whose function or arguments do not pickle (nothing was sent).

    Example:
      >>> str(unpicklable_error("rpc_sync(f) on worker 'w1' (rank 1)", TypeError("lock")))[:60]
      "parallax.rpc: cannot send rpc_sync(f) on worker 'w1' (rank 1"
    """
    return TypeError(
        f"parallax.rpc: cannot send {describe}: its function or arguments do not pickle "
        f"({type(error).__name__}: {error}); pass a module-level function and arrays, pytrees "
        "or RRefs (no locks, sockets or open files in a closure)")


class RemoteTraceback(Exception):
    """Where a function's exception was raised: the worker, its rank and the traceback text.

    The ``__cause__`` of an exception re-raised on the caller.

    Example:
      >>> cause = RemoteTraceback("w1", 1, "Traceback ...\\nValueError: bad")
      >>> cause.worker, cause.rank
      ('w1', 1)
    """

    def __init__(self, worker: str, rank: int, traceback: str):
        super().__init__(worker, rank, traceback)
        self.worker, self.rank, self.traceback = worker, rank, traceback

    def __str__(self) -> str:
        return f"On worker {self.worker!r} (rank {self.rank}):\n{self.traceback.rstrip()}"


def raised_on(error: BaseException, worker: str, rank: int, traceback: str) -> BaseException:
    """``error``, marked as raised by worker ``worker`` (chained from its remote traceback).

    Example:
      >>> e = raised_on(KeyError("k"), "w2", 2, "Traceback ...")
      >>> e.__cause__.worker, e.__notes__
      ('w2', ["raised on worker 'w2' (rank 2) of the parallax.rpc group"])
    """
    if not isinstance(error.__cause__, RemoteTraceback):
        error.__cause__ = RemoteTraceback(worker, rank, traceback)
        error.add_note(f"raised on worker {worker!r} (rank {rank}) of the parallax.rpc group")
    return error
