"""Watching a run: per-step throughput, MFU and memory; logs; profiles (``px.metrics``).

- :class:`Throughput`: step time, tokens (or examples) per second per device, MFU against
  the device's peak, memory in use and peak, the data-loading wait.
- :class:`MetricsLog`: JSON lines and TensorBoard event files, process 0 only by default.
- :func:`profile`: a ``jax.profiler`` trace of chosen steps (Perfetto / TensorBoard).
- :class:`Monitor`: all three around a training loop, with a progress bar and a final table
  (:func:`add_arguments`: a script's ``--logdir`` and ``--profile-steps``).
- :class:`Evaluation`: held-out loss and perplexity every N steps, under the training
  strategy (``monitor.record`` logs them and shows them in the bar).
"""

from parallax.metrics.device_memory import DeviceMemory, device_memory, live_bytes
from parallax.metrics.evaluation import Evaluation
from parallax.metrics.monitor import Monitor, add_arguments
from parallax.metrics.peak import peak_flops_per_device
from parallax.metrics.profiling import Profiler, parse_steps, profile
from parallax.metrics.throughput import StepMetrics, Throughput
from parallax.metrics.writers import MetricsLog

__all__ = ["DeviceMemory", "Evaluation", "MetricsLog", "Monitor", "Profiler", "StepMetrics", "Throughput",
           "add_arguments", "device_memory", "live_bytes", "parse_steps",
           "peak_flops_per_device", "profile"]
