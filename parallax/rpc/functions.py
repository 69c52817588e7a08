"""``@async_execution``: a function that returns a Future, whose value is the call's answer."""

from __future__ import annotations

from collections.abc import Callable

ASYNC_EXECUTION = "_parallax_rpc_async_execution"


def async_execution(fn: Callable) -> Callable:
    """Marks ``fn`` as returning a :class:`parallax.rpc.Future`; the caller gets its value.

    The callee waits for the future on the thread that ran ``fn`` (PyTorch's callee frees
    its thread until the future completes: the difference is one waiting thread per call).

    Example:
      >>> from parallax.rpc.future import Future
      >>> @async_execution
      ... def answer():
      ...     f = Future(); f.set_result(42); return f
      >>> getattr(answer, ASYNC_EXECUTION)
      True

    References:
      PyTorch, ``torch.distributed.rpc.functions.async_execution``.
    """
    setattr(fn, ASYNC_EXECUTION, True)
    return fn
