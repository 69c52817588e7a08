"""Measuring each layer of a sequential model: time, flops, parameter and activation bytes.

``px.pipeline.profile_layers`` (called ``profile`` before round 4, a name that
``px.profile``, a ``jax.profiler`` trace of steps, also has) measures what
``px.pipeline.partition`` balances.
"""

from __future__ import annotations

import math
import statistics
import time as _time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from parallax.old_import_paths import renamed_names


class LayerProfile(NamedTuple):
    """What :func:`profile_layers` measured for one layer; usable as a cost by ``partition``."""

    name: str
    time: float  # seconds: median of the repeats of the compiled forward
    flops: float  # XLA's cost analysis of the compiled forward; nan when the backend gives none
    param_bytes: int  # bytes of the layer's parameters
    activation_bytes: int  # bytes of the layer's output (what a stage boundary would send)


def profile_layers(
    layers: Sequence[Any],
    sample: Any,
    *,
    repeats: int = 5,
    warmup: int = 1,
) -> tuple[LayerProfile, ...]:
    """Profiles layers applied in sequence to ``sample``, one compiled program per layer.

    Each layer is compiled with ``jax.jit`` for the output of the layer before it, run
    ``warmup`` times (at least once, to get its output), then timed ``repeats`` times
    (``block_until_ready``); the time is the median. Flops come from the compiled program's
    ``cost_analysis()``.

    Args:
      layers: each a callable ``f(x)``, a pair ``(f, params)`` called ``f(params, x)``, or a
        Flax ``nnx.Module`` called ``module(x)``. ``params`` may be an ``nnx.Module`` too
        (``(lambda m, x: m.embed(x), model)``); a module's ``nnx.Param`` variables are the
        parameters counted.
      sample: the input of the first layer (a pytree of arrays: one micro-batch).
      repeats: timed runs per layer, >= 1.
      warmup: untimed runs per layer before timing, >= 0.

    Returns:
      One :class:`LayerProfile` per layer.

    Raises:
      TypeError: for a layer of another kind; errors raised by a layer carry a note naming it.

    Example:
      >>> import jax.numpy as jnp
      >>> from parallax.pipeline import partition, profile_layers
      >>> dense = lambda p, x: x @ p
      >>> layers = [(dense, jnp.ones((8, 16))), jnp.tanh, (dense, jnp.ones((16, 4)))]
      >>> records = profile_layers(layers, jnp.ones((2, 8)), repeats=2)
      >>> records[0].flops, records[0].param_bytes, records[0].activation_bytes
      (512.0, 512, 128)
      >>> partition(records, stages=2).stages
      2

    References:
      Narayanan et al. 2019, PipeDream (profiling each layer's compute time, output
      activation size and parameter size); Kim et al. 2020, torchgpipe (balance by time/size).
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"profile_layers: repeats must be an int >= 1, got {repeats!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"profile_layers: warmup must be an int >= 0, got {warmup!r}")
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence) or not layers:
        raise TypeError(
            "profile_layers: layers must be a non-empty sequence of callables, (f, params) pairs "
            "or nnx.Modules"
        )
    records = []
    x = sample
    for i, layer in enumerate(layers):
        name, fn, args, params = _normalise(layer, i)
        try:
            compiled = jax.jit(fn).lower(args, x).compile()
            for _ in range(max(warmup, 1)):
                out = jax.block_until_ready(compiled(args, x))
            times = []
            for _ in range(repeats):
                start = _time.perf_counter()
                jax.block_until_ready(compiled(args, x))
                times.append(_time.perf_counter() - start)
        except Exception as error:
            shapes = jax.tree.map(lambda a: tuple(np.shape(a)), x)
            error.add_note(f"profile_layers: raised by layers[{i}] ({name}) on an input of "
                           f"shape {shapes}")
            raise
        records.append(
            LayerProfile(
                name, statistics.median(times), _flops(compiled), _nbytes(params), _nbytes(out)
            )
        )
        x = out
    return tuple(records)


def _normalise(layer, i: int) -> tuple[str, Callable, Any, Any]:
    """``(name, fn(args, x), args, params)`` for one layer."""
    from flax import nnx

    if isinstance(layer, nnx.Module):
        layer = (lambda module, x: module(x), layer)
        name = type(layer[1]).__name__
    elif isinstance(layer, tuple) and len(layer) == 2 and callable(layer[0]):
        name = _name(layer[0])
    elif callable(layer):
        return _name(layer), lambda args, x: layer(x), (), ()
    else:
        raise TypeError(
            f"profile_layers: layers[{i}] is a {type(layer).__name__}; pass a callable f(x), a "
            "pair (f, params) called f(params, x), or an nnx.Module"
        )
    f, params = layer
    if not isinstance(params, nnx.Module):
        return name, f, params, params
    # A module travels as its state; only its nnx.Param variables count as parameters.
    graphdef, weights, rest = nnx.split(params, nnx.Param, ...)
    fn = lambda args, x: f(nnx.merge(graphdef, *args), x)  # noqa: E731
    return name, fn, (weights, rest), weights


def _name(fn) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def _flops(compiled) -> float:
    """Flops from ``cost_analysis()``: a dict, or (older JAX) a list with one dict per program."""
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0] if analysis else None
    if not analysis:
        return math.nan
    return float(analysis.get("flops", 0.0))  # XLA leaves the key out when it counts none



def _nbytes(tree) -> int:
    total = 0
    for leaf in jax.tree.leaves(tree):
        total += (
            int(np.prod(np.shape(leaf), dtype=np.int64))
            * np.dtype(jax.numpy.result_type(leaf)).itemsize
        )
    return total


__getattr__ = renamed_names(__name__, globals())  # profile, with a warning
