"""A training loop's metrics in one object: the progress bar, the log, the profile, the table.

:class:`Monitor` owns a :class:`~parallax.metrics.Throughput`, a
:class:`~parallax.metrics.MetricsLog` (with ``logdir``) and a
:class:`~parallax.metrics.Profiler` (with ``profile_steps``), and shows each step's
tokens (or examples) per second per device, MFU and memory in a ``tqdm`` bar's postfix, as
torchtitan's and Levanter's loops print them every step. ``parallax demo``, the scripts in
``examples/`` and the notebooks use it; :func:`add_arguments` gives a script the demo's
``--logdir`` and ``--profile-steps``.
"""

from __future__ import annotations

import argparse
import pathlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import jax

from parallax.metrics.profiling import Profiler, parse_steps
from parallax.metrics.throughput import StepMetrics, Throughput, compile_step
from parallax.metrics.writers import MetricsLog

DEFAULT_PROFILE_DIR = "parallax-logs"


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds ``--logdir`` and ``--profile-steps`` (as ``parallax demo`` has them) to a parser.

    Example:
      >>> parser = add_arguments(argparse.ArgumentParser())
      >>> args = parser.parse_args(["--logdir", "runs/a", "--profile-steps", "3:5"])
      >>> args.logdir, args.profile_steps
      ('runs/a', '3:5')
    """
    parser.add_argument("--logdir", default=None,
                        help="write each step's metrics (throughput, MFU, memory, loss) to "
                             "LOGDIR/metrics.jsonl and TensorBoard event files")
    parser.add_argument("--profile-steps", default=None, metavar="FIRST:STOP",
                        help="trace these steps with jax.profiler (e.g. 3:5) into --logdir "
                             f"(./{DEFAULT_PROFILE_DIR} without one); open in Perfetto or "
                             "TensorBoard")
    return parser


class Monitor:
    """Measures, shows, logs and profiles the steps of a training loop.

    Args:
      meter: the :class:`Throughput` that measures each step; or, without one,
      items_per_step: tokens (or examples) per step, all devices, and
      flops_per_step: the step's FLOPs, all devices (e.g. ``px.models.flops_per_token(config)
        * tokens``, the papers' MFU; None: no MFU), for a new :class:`Throughput`.
      logdir: where each step's metrics go (``metrics.jsonl``, TensorBoard events); None: no log.
      profile_steps: steps to trace (``"3:5"`` or a ``range``, 1-based) into ``logdir``
        (``./parallax-logs`` without one); None: no trace.
      progress: show a ``tqdm`` bar; ``"auto"``: on process 0 only.
      description: the bar's label.
      unit: the items' name in the bar (``"tok"``, ``"ex"``).
      first_step: the number of the loop's first step (a resumed run's next step).

    Use :meth:`loop` around the batches and :meth:`step` after each step; :meth:`record`
    adds values measured now and then (a held-out evaluation's loss and perplexity, from
    :class:`~parallax.metrics.Evaluation`) to the log and keeps them in the bar;
    :meth:`close` (or ``with``) ends the trace and the log; :meth:`table` is the summary.

    Example:
      >>> import jax, jax.numpy as jnp, tempfile
      >>> step = jax.jit(lambda w, x: (w - 0.1 * x.mean(0), {"loss": (x @ w).sum()}))
      >>> w, batches = jnp.ones(4), [jnp.ones((8, 4))] * 3
      >>> run = tempfile.mkdtemp()
      >>> with Monitor.for_step(step, w, batches[0], items_per_step=8, logdir=run,
      ...                       progress=False) as monitor:
      ...     for batch in monitor.loop(batches):
      ...         w, out = step(w, batch)
      ...         measured = monitor.step(out, loss=out["loss"])
      >>> sorted(monitor.postfix(measured, loss=out["loss"]))   # what the bar showed
      ['MFU', 'loss', 'mem', 'tok/s/dev']
      >>> print(monitor.table().splitlines()[0])
      steps measured        2 (first 1 skipped: compilation)

    References:
      torchtitan's ``MetricsProcessor`` and Levanter's tracker (per-step throughput, MFU and
      memory beside the loss); ``tqdm.set_postfix``.
    """

    def __init__(self, meter: Throughput | None = None, *, items_per_step: int | None = None,
                 flops_per_step: float | None = None, logdir: str | pathlib.Path | None = None,
                 profile_steps: str | range | None = None, progress: bool | str = "auto",
                 description: str | None = None, unit: str = "tok", first_step: int = 1):
        if progress not in (True, False, "auto"):
            raise ValueError(f"px.metrics.Monitor: progress must be True, False or 'auto', "
                             f"got {progress!r}.")
        if (meter is None) == (items_per_step is None):
            raise ValueError("px.metrics.Monitor: pass a Throughput meter or items_per_step "
                             f"(with flops_per_step), not both nor neither; got meter={meter!r}, "
                             f"items_per_step={items_per_step!r}.")
        self.meter = meter or Throughput(items_per_step=items_per_step,
                                         flops_per_step=flops_per_step)
        self.logdir = None if logdir is None else pathlib.Path(logdir)
        self.progress = jax.process_index() == 0 if progress == "auto" else progress
        self.description, self.unit = description, unit
        self.next_step = first_step
        steps = parse_steps(profile_steps) if isinstance(profile_steps, str) else profile_steps
        self.profiler = steps and Profiler(self.logdir or DEFAULT_PROFILE_DIR, steps)
        self.log = MetricsLog(self.logdir) if self.logdir is not None else None
        self._bar = None
        self._recorded: dict[str, Any] = {}  # shown in the bar until recorded again

    @classmethod
    def for_compiled(cls, compiled, *, items_per_step: int, flops_per_step=None,
                     meter_options: Mapping[str, Any] | None = None, **options: Any) -> Monitor:
        """A monitor whose meter reads FLOPs and the memory peak from a compiled step.

        ``options`` are :class:`Monitor`'s; ``meter_options`` go to :class:`Throughput`
        (``dtype``, ``peak_flops``, ``devices``).
        """
        meter = Throughput.for_compiled(compiled, items_per_step=items_per_step,
                                        flops_per_step=flops_per_step, **(meter_options or {}))
        return cls(meter, **options)

    @classmethod
    def for_step(cls, step, *args: Any, items_per_step: int, flops_per_step=None,
                 meter_options: Mapping[str, Any] | None = None, **options: Any) -> Monitor:
        """A monitor for ``step`` compiled for ``args``.

        This compiles ``step`` here (:func:`~parallax.metrics.throughput.compile_step`: a
        ``px.train_step``'s later calls run that program). Where a model formula gives the
        FLOPs (``px.models.flops_per_token``), ``Monitor(items_per_step=..., flops_per_step=...)``
        compiles nothing.
        """
        return cls.for_compiled(compile_step(step, *args), items_per_step=items_per_step,
                                flops_per_step=flops_per_step, meter_options=meter_options,
                                **options)

    def loop(self, batches: Iterable, total: int | None = None) -> Iterator:
        """Yields ``batches`` behind the bar, timing the wait for each and starting the
        profile at its first step; starts the step clock."""
        if self.progress:
            from tqdm.auto import tqdm

            batches = self._bar = tqdm(batches, desc=self.description, total=total,
                                       unit="step", leave=True)
        self.meter.start()
        for batch in self.meter.timed(batches):
            if self.profiler:
                self.profiler.step(self.next_step)
            yield batch

    def step(self, outputs: Any = None, **shown: Any) -> StepMetrics:
        """Ends a step: waits for ``outputs``, measures, logs ``shown`` (e.g. ``loss=``) with
        the metrics, and shows both in the bar."""
        measured = self.meter.step(outputs)
        if self.log:
            self.log.write(self.next_step, dict(shown) | measured.as_dict())
        if self._bar is not None:
            self._bar.set_postfix(self.postfix(measured, **shown))
        self.next_step += 1
        return measured

    def record(self, values: Mapping[str, Any], step: int | None = None) -> None:
        """Logs ``values`` at ``step`` (default: the last step measured) and shows them in
        the bar from now on, beside each step's fields, until recorded again.

        Example:
          >>> monitor = Monitor(items_per_step=8, progress=False)
          >>> monitor.record({"eval_loss": 2.0, "eval_perplexity": 7.389})
          >>> measured = StepMetrics(1, 0.5, 0.0, 16.0, 2.0, None, None, 0, None)
          >>> monitor.postfix(measured, loss=2.1)["eval_loss"]
          '2.0000'
        """
        values = dict(values)
        if self.log:
            self.log.write(self.next_step - 1 if step is None else step, values)
        self._recorded.update(values)
        if self._bar is not None:
            self._bar.set_postfix(self._recorded_fields(), refresh=True)

    def _recorded_fields(self) -> dict[str, str]:
        return {name: f"{float(value):.4f}" if _is_number(value) else str(value)
                for name, value in self._recorded.items()}

    def postfix(self, measured: StepMetrics, **shown: Any) -> dict[str, str]:
        """The bar's fields: ``shown`` (numbers to 4 decimals), then the values
        :meth:`record` keeps, then the step's metrics."""
        fields = {name: f"{float(value):.4f}" if _is_number(value) else str(value)
                  for name, value in shown.items()}
        return fields | self._recorded_fields() | measured.postfix(self.unit)

    def table(self, skip: int = 1) -> str:
        """The summary (medians after the first ``skip`` steps), and where logs and traces
        went."""
        unit = {"tok": "tokens", "ex": "examples"}.get(self.unit, self.unit)
        lines = [self.meter.table(unit=unit, skip=skip)]
        if self.log and self.log.enabled:
            lines.append(f"metrics logged to {self.logdir}/metrics.jsonl"
                         + (" and TensorBoard events" if self.log.writes_tensorboard else ""))
        if self.profiler:
            first, last = self.profiler.steps.start, self.profiler.steps.stop - 1
            traced = f"step {first}" if first == last else f"steps {first} to {last}"
            lines.append(f"profile of {traced} in {self.profiler.logdir}/plugins/profile "
                         "(Perfetto, TensorBoard)")
        return "\n".join(lines)

    def close(self) -> None:
        """Stops the trace (if the last chosen step was the loop's last) and closes the log
        and the bar."""
        if self.profiler:
            self.profiler.close()
        if self.log:
            self.log.close()
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _is_number(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return not isinstance(value, str)
