"""Metrics to disk: JSON lines always, TensorBoard event files when ``tensorboardX`` is there.

One :class:`MetricsLog` per run writes ``DIR/metrics.jsonl`` (one JSON object per step, read
back with any JSON reader) and, if the optional ``tensorboardX`` package is installed
(``pip install parallax[metrics]``), ``DIR/events.out.tfevents.*`` for TensorBoard. Only process
0 writes unless ``all_processes=True`` (then each process writes ``DIR/process_<i>/``), so a
multi-host run does not write the same numbers N times.
"""

from __future__ import annotations

import json
import math
import pathlib
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np


def _scalar(value: Any) -> int | float | None:
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value)
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


class MetricsLog:
    """Writes per-step metrics as JSON lines and (optionally) TensorBoard scalars.

    Args:
      logdir: the run's directory (created).
      tensorboard: ``"auto"`` (when ``tensorboardX`` imports), True (required), False.
      all_processes: every process writes (into ``process_<index>/``); default only process 0.

    Example:
      >>> import json, tempfile, pathlib
      >>> d = tempfile.mkdtemp()
      >>> with MetricsLog(d, tensorboard=False) as log:
      ...     log.write(1, {"loss": 2.5, "mfu": 0.1})
      >>> json.loads((pathlib.Path(d) / "metrics.jsonl").read_text())
      {'step': 1, 'loss': 2.5, 'mfu': 0.1}
    """

    def __init__(self, logdir: str | pathlib.Path, *, tensorboard: bool | str = "auto",
                 all_processes: bool = False):
        self.enabled = all_processes or jax.process_index() == 0
        root = pathlib.Path(logdir)
        self.logdir = root / f"process_{jax.process_index()}" if all_processes else root
        self._jsonl = self._tensorboard = None
        if not self.enabled:
            return
        self.logdir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.logdir / "metrics.jsonl", "a", encoding="utf-8")
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter
            except ImportError:
                if tensorboard is True:
                    raise ImportError(
                        "px.metrics.MetricsLog(tensorboard=True) needs tensorboardX: "
                        "pip install 'parallax[metrics]' (or tensorboard=False for JSON "
                        "lines only).") from None
            else:
                self._tensorboard = SummaryWriter(str(self.logdir))

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Records ``metrics`` at ``step``: numbers (non-finite ones as null) and strings."""
        if not self.enabled:
            return
        row: dict[str, Any] = {"step": int(step)}
        for name, value in metrics.items():
            if name != "step":
                row[name] = value if isinstance(value, str) else _scalar(value)
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        if self._tensorboard is not None:
            for name, value in row.items():
                if name != "step" and isinstance(value, (int, float)):
                    self._tensorboard.add_scalar(name, value, int(step))

    @property
    def writes_tensorboard(self) -> bool:
        """Whether TensorBoard event files are written too (``tensorboardX`` is there)."""
        return self._tensorboard is not None

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
