"""Profiles of chosen steps: a ``jax.profiler`` trace, viewable in Perfetto or TensorBoard.

``px.profile(logdir, steps=range(3, 5))`` traces steps 3 and 4 (1-based, as the demo counts
them): call ``profiler.step(i)`` at the start of every step and ``profiler.close()`` at the
end. The trace lands in ``logdir/plugins/profile/<run>/`` (``*.xplane.pb`` for TensorBoard's
profile plugin, ``perfetto_trace.json.gz`` for https://ui.perfetto.dev). parallax names what
it sends in the compiled program with ``jax.named_scope`` (``parallax/...`` in each op's
metadata), so the trace's device ops show which strategy sent what.
"""

from __future__ import annotations

import pathlib

import jax


def parse_steps(text: str) -> range:
    """``"3:5"`` -> steps 3 and 4 (a Python slice's meaning); ``"3"`` -> step 3 alone.

    Example:
      >>> list(parse_steps("3:5")), list(parse_steps("7"))
      ([3, 4], [7])
    """
    try:
        first, _, stop = text.partition(":")
        start = int(first)
        end = int(stop) if stop else start + 1
    except ValueError:
        raise ValueError(f"px.profile: steps {text!r} must be FIRST:STOP (e.g. 3:5 traces "
                         "steps 3 and 4) or one step number.") from None
    if not 1 <= start < end:
        raise ValueError(f"px.profile: steps {text!r} must satisfy 1 <= FIRST < STOP (steps "
                         "count from 1).")
    return range(start, end)


class Profiler:
    """Starts a ``jax.profiler`` trace at the first chosen step, stops it after the last.

    Args:
      logdir: where the trace goes.
      steps: the steps to trace (1-based; a ``range`` or a ``"FIRST:STOP"`` string).

    Example:
      >>> import tempfile, jax.numpy as jnp
      >>> profiler = Profiler(tempfile.mkdtemp(), steps="2:3")
      >>> for i in range(1, 4):
      ...     profiler.step(i)
      ...     _ = (jnp.ones(4) * i).block_until_ready()
      >>> profiler.close()
      >>> len(profiler.trace_files()) > 0
      True

    References:
      ``jax.profiler.start_trace`` / ``stop_trace``; Perfetto (https://perfetto.dev).
    """

    def __init__(self, logdir: str | pathlib.Path, steps: range | str):
        self.logdir = pathlib.Path(logdir)
        self.steps = parse_steps(steps) if isinstance(steps, str) else steps
        if not isinstance(self.steps, range) or len(self.steps) == 0:
            raise ValueError(f"px.profile: steps must be a non-empty range or 'FIRST:STOP', "
                             f"got {steps!r}.")
        self.tracing = False

    def step(self, index: int) -> None:
        """Call at the start of step ``index`` (1-based)."""
        if index == self.steps.start and not self.tracing:
            self.logdir.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.logdir), create_perfetto_trace=True)
            self.tracing = True
        elif index == self.steps.stop and self.tracing:
            self.close()

    def close(self) -> None:
        """Stops the trace if it runs (after the loop, for a last chosen step)."""
        if self.tracing:
            jax.effects_barrier()
            jax.profiler.stop_trace()
            self.tracing = False

    def trace_files(self) -> list[pathlib.Path]:
        """The trace files written so far."""
        return sorted(self.logdir.glob("plugins/profile/*/*"))


def profile(logdir: str | pathlib.Path, steps: range | str = "3:5") -> Profiler:
    """``px.profile``: a :class:`Profiler` of ``steps`` into ``logdir``.

    Example:
      >>> import tempfile
      >>> profile(tempfile.mkdtemp(), "3:5").steps
      range(3, 5)
    """
    return Profiler(logdir, steps)
