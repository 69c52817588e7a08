"""``hvd.start_timeline`` / ``hvd.stop_timeline``: Horovod's timeline as a JAX profiler trace.

Horovod writes a Chrome-trace JSON of every collective's phases (negotiation, queueing,
the MPI/NCCL call). Here the timeline is ``jax.profiler``'s trace of the process (a
TensorBoard/Perfetto trace under ``path``: ``plugins/profile/<run>/*.trace.json.gz`` and
``*.xplane.pb``). Every Horovod op is named ``horovod/<op>``: an eager call is a host event
of that name in the trace; a call inside ``@hvd.jit`` is a ``jax.named_scope``, so its
instructions carry the name in the compiled HLO's ``op_name`` metadata, which GPU and TPU
device traces show per kernel (the CPU backend's trace has no per-instruction events).
There are no negotiation phases to show: XLA orders collectives at compile time.

Example:
  >>> import tempfile, numpy as np, parallax.horovod as hvd
  >>> path = tempfile.mkdtemp()
  >>> hvd.start_timeline(path)
  >>> _ = hvd.allreduce(np.ones(2))
  >>> hvd.stop_timeline()

References:
  Horovod's timeline (docs/timeline.rst; ``hvd.start_timeline(file_path, mark_cycles)``,
  ``hvd.stop_timeline()`` in horovod/common/basics.py); ``jax.profiler.start_trace``.
"""

from __future__ import annotations

import functools
import os

import jax


def scoped(name: str):
    """Decorates a Horovod op: its work is named ``horovod/<name>`` in traces and HLO."""
    label = f"horovod/{name}"

    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            with jax.profiler.TraceAnnotation(label), jax.named_scope(label):
                return fn(*args, **kwargs)
        return inner

    return wrap


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Starts recording this process's timeline under the directory ``file_path``.

    Args:
      file_path: a directory (created if missing); Horovod takes a file name, and a path
        ending in ``.json`` is used as a directory of that name.
      mark_cycles: Horovod's cycle markers; accepted and ignored (no background cycles here).
    """
    del mark_cycles
    os.makedirs(file_path, exist_ok=True)
    jax.profiler.start_trace(file_path, create_perfetto_trace=True)


def stop_timeline() -> None:
    """Stops recording and writes the trace (a no-op when none is running)."""
    try:
        jax.profiler.stop_trace()
    except RuntimeError as error:  # no trace running: Horovod's stop is a no-op then
        if "No profile started" not in str(error):
            raise
