"""Per-step training metrics: step time, throughput, MFU, memory and the data-loading wait.

What torchtitan, MaxText and Levanter print every step, for any parallax (or plain ``jax.jit``)
step. MFU, model FLOPs utilisation (Chowdhery et al. 2022, "PaLM", appendix B)::

    MFU = flops_per_step / (step_seconds * devices * peak_flops_per_device)

``flops_per_step`` is the whole step's FLOPs over all devices: a model formula (e.g.
``GPTConfig.flops_per_token(T) * tokens``, the papers' MFU) or, with :meth:`Throughput.for_step`,
what the compiled program executes (:func:`parallax.analysis.executed.executed_cost` per device
times the devices; that counts recomputation too, so it is the papers' HFU where remat is on).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax

from parallax.analysis import hlo
from parallax.analysis.executed import executed_cost
from parallax.analysis.kernels import attention_kernels
from parallax.metrics.device_memory import device_memory
from parallax.metrics.peak import peak_flops_per_device


@dataclasses.dataclass(frozen=True)
class StepMetrics:
    """One step's measurements (seconds, items = tokens or examples, bytes of one device)."""

    step: int
    seconds: float
    data_wait_seconds: float
    items_per_second: float
    items_per_second_per_device: float
    flops_per_second_per_device: float | None
    mfu: float | None
    memory_in_use_bytes: int
    memory_peak_bytes: int | None

    def as_dict(self) -> dict[str, float | int | None]:
        return dataclasses.asdict(self)

    def postfix(self, unit: str = "tok") -> dict[str, str]:
        """Short fields for a progress bar (``tqdm.set_postfix``)."""
        shown = {f"{unit}/s/dev": f"{self.items_per_second_per_device:,.0f}"}
        if self.mfu is not None:
            shown["MFU"] = f"{100 * self.mfu:.1f}%"
        shown["mem"] = f"{self.memory_in_use_bytes / 2**20:,.1f}MiB"
        return shown


class Throughput:
    """Measures each step of a training loop.

    Args:
      items_per_step: tokens (or examples) the whole step consumes, over all devices.
      flops_per_step: the step's FLOPs over all devices (None: no MFU).
      devices: how many devices run the step (default: all of ``jax.devices()``).
      dtype: the matmuls' dtype, which picks the peak (``"bfloat16"``, ``"float32"``).
      peak_flops: peak FLOP/s per device instead of the chip table's.
      compiled_peak_bytes: the compiled step's bytes per device (the memory peak where the
        runtime reports none).
      attention: the attention kernel the step runs (:meth:`for_compiled` reads it from the
        program: ``"cudnn (4 fused calls)"``, ``"xla"``, ``"none"``), shown in the table.
      clock: seconds since some origin (``time.perf_counter``; tests pass a fake one).

    Example:
      >>> ticks = iter([0.0, 0.5, 2.5])           # a fake clock: steps of 0.5 s and 2 s
      >>> meter = Throughput(items_per_step=1000, flops_per_step=4e9, devices=8,
      ...                    peak_flops=1e9, clock=lambda: next(ticks))
      >>> first = meter.step()
      >>> first.items_per_second, first.items_per_second_per_device, first.mfu
      (2000.0, 250.0, 1.0)
      >>> meter.step().mfu    # 4e9 FLOPs in 2 s on 8 devices of 1e9 FLOP/s each
      0.25

    References:
      Chowdhery et al. 2022 (PaLM), appendix B: model FLOPs utilisation.
    """

    def __init__(self, *, items_per_step: int, flops_per_step: float | None = None,
                 devices: int | None = None, dtype: str = "float32",
                 peak_flops: float | None = None, compiled_peak_bytes: int | None = None,
                 attention: str | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        if not (isinstance(items_per_step, int) and items_per_step > 0):
            raise ValueError(f"px.metrics.Throughput: items_per_step must be a positive int "
                             f"(tokens or examples per step, all devices), got "
                             f"{items_per_step!r}.")
        if flops_per_step is not None and not flops_per_step > 0:
            raise ValueError(f"px.metrics.Throughput: flops_per_step must be > 0 or None, "
                             f"got {flops_per_step!r}.")
        self.items_per_step = items_per_step
        self.flops_per_step = flops_per_step
        self.devices = devices or jax.device_count()
        self.peak_flops, self.peak_source = peak_flops_per_device(dtype=dtype,
                                                                  peak_flops=peak_flops)
        self.compiled_peak_bytes = compiled_peak_bytes
        self.attention = attention
        self.history: list[StepMetrics] = []
        self._clock = clock
        self._last = clock()
        self._wait = 0.0

    @classmethod
    def for_step(cls, step, *args: Any, items_per_step: int, flops_per_step=None,
                 **kwargs: Any) -> Throughput:
        """A meter whose FLOPs and memory peak are read from ``step`` compiled for ``args``.

        ``step`` is a ``@px.train_step`` (or ``jax.jit``) function, compiled here by
        :func:`compile_step`.
        """
        return cls.for_compiled(compile_step(step, *args), items_per_step=items_per_step,
                                flops_per_step=flops_per_step, **kwargs)

    @classmethod
    def for_compiled(cls, compiled, *, items_per_step: int, flops_per_step=None,
                     **kwargs: Any) -> Throughput:
        """A meter whose FLOPs (executed per device, times the devices), memory peak and
        attention kernel are read from a compiled step (``step.lower(...).compile()``)."""
        devices = kwargs.pop("devices", None) or _program_devices(compiled)
        if flops_per_step is None:
            flops_per_step = executed_cost(compiled).flops * devices or None
        kwargs.setdefault("attention", attention_kernels(compiled).summary())
        return cls(items_per_step=items_per_step, flops_per_step=flops_per_step,
                   devices=devices, compiled_peak_bytes=hlo.memory(compiled).peak_bytes,
                   **kwargs)

    def start(self) -> None:
        """Restarts the clock (call it just before the loop if setup came in between)."""
        self._last = self._clock()
        self._wait = 0.0

    def timed(self, batches: Iterable) -> Iterator:
        """Yields ``batches``, counting the time spent waiting for each as data wait."""
        iterator = iter(batches)
        while True:
            before = self._clock()
            try:
                item = next(iterator)
            except StopIteration:
                return
            self._wait += self._clock() - before
            yield item

    def step(self, outputs: Any = None) -> StepMetrics:
        """Ends a step: waits for ``outputs`` to be computed, then measures since the last."""
        jax.block_until_ready(outputs)
        now = self._clock()
        seconds, self._last = now - self._last, now
        per_second = self.items_per_step / seconds if seconds > 0 else 0.0
        flops = mfu = None
        if self.flops_per_step is not None and seconds > 0:
            flops = self.flops_per_step / seconds / self.devices
            mfu = flops / self.peak_flops
        memory = device_memory(compiled_peak=self.compiled_peak_bytes)
        metrics = StepMetrics(len(self.history) + 1, seconds, self._wait, per_second,
                              per_second / self.devices, flops, mfu, memory.in_use, memory.peak)
        self._wait = 0.0
        self.history.append(metrics)
        return metrics

    def summary(self, skip: int = 1) -> dict[str, float]:
        """Medians over the steps after the first ``skip`` (the first one compiles).

        Medians, not means: a step that saved a checkpoint, was profiled or met a busy
        machine does not move them.
        """
        kept = self.history[skip:] or self.history
        if not kept:
            raise ValueError("px.metrics.Throughput.summary: no step measured yet; call "
                             "meter.step(outputs) once per training step.")
        seconds = statistics.median(m.seconds for m in kept)
        out = {"steps": len(kept), "seconds": seconds,
               "data_wait_seconds": statistics.median(m.data_wait_seconds for m in kept),
               "items_per_second": self.items_per_step / seconds if seconds else 0.0}
        out["items_per_second_per_device"] = out["items_per_second"] / self.devices
        if self.flops_per_step is not None and seconds:
            out["mfu"] = self.flops_per_step / seconds / self.devices / self.peak_flops
        out["memory_peak_bytes"] = max((m.memory_peak_bytes or m.memory_in_use_bytes)
                                       for m in kept)
        return out

    def table(self, unit: str = "tokens", skip: int = 1) -> str:
        """The summary as a small text table (the demo prints it at the end)."""
        s = self.summary(skip)
        rows = [("steps measured", f"{s['steps']} (first {skip} skipped: compilation)"),
                ("step time (median)", f"{1e3 * s['seconds']:,.1f} ms"),
                ("data wait (median)", f"{1e3 * s['data_wait_seconds']:,.2f} ms"),
                (f"{unit}/s", f"{s['items_per_second']:,.0f}"),
                (f"{unit}/s per device", f"{s['items_per_second_per_device']:,.0f}")]
        if "mfu" in s:
            rows.append(("MFU", f"{100 * s['mfu']:.2f}% of {self.peak_flops:.3g} FLOP/s per "
                                f"device ({self.peak_source})"))
        rows.append(("memory peak / device", f"{s['memory_peak_bytes'] / 2**20:,.1f} MiB"))
        if self.attention is not None:
            rows.append(("attention kernel", self.attention))
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def compile_step(step, *args: Any):
    """``step`` compiled for ``args``: a ``px.train_step``'s ``compile``, whose program its
    later calls run (compiled once), else ``step.lower(*args).compile()`` (a ``jax.jit``
    function then compiles again on its first call: jax keeps the two caches apart)."""
    if hasattr(step, "compile"):
        return step.compile(*args)
    return step.lower(*args).compile()


def _program_devices(compiled) -> int:
    shardings = jax.tree.leaves(compiled.input_shardings)
    return max((len(s.device_set) for s in shardings), default=1)
