"""The errors a caller of ``parallax.rpc`` sees: a worker that died, a call past its timeout."""

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


class RPCTimeoutError(TimeoutError):
    """A call did not answer within its ``timeout`` seconds.

    Example:
      >>> isinstance(RPCTimeoutError("late"), TimeoutError)
      True

    References:
      PyTorch, ``torch.distributed.rpc.rpc_async(..., timeout=)``: the future raises a
      timeout error once the deadline passes.
    """
