"""A mixed-precision policy: the dtypes parameters are kept, computed, differentiated and summed in.

A :class:`Policy` is a value (JMP's idea): ``params`` is the dtype the trained parameters
are stored in (the fp32 master copy), ``compute`` the dtype of the forward and backward
passes (parameters and floating batch leaves are cast to it; the loss comes back in
float32), ``grads`` the dtype of the gradients ``px.value_and_grad`` returns, and
``reduce`` the dtype their cross-device sum travels in. The gradient with respect to the
master parameters comes out through the cast, so autodiff needs nothing special. float16
needs loss scaling (:mod:`parallax.loss_scale`); ``loss_scale="dynamic"`` is its default
there. :func:`default_compute_dtype` is what benchmarks and examples compute in by default
(bf16 on accelerators), :func:`add_arguments` their ``--precision`` flag.

References:
  Micikevicius et al., "Mixed Precision Training", ICLR 2018 (fp32 master weights, loss
  scaling); DeepMind JMP (``jmp.Policy``, ``jmp.DynamicLossScale``).
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from parallax.rules import readable_path

FLOATS = ("float32", "bfloat16", "float16")
LOSS_SCALES = ("dynamic", None)


def dtype_name(api: str, field: str, value) -> str:
    """The canonical name of a floating dtype (``"bfloat16"``), or a pinned error."""
    try:
        name = jnp.dtype(value).name
    except TypeError:
        name = None
    if name not in FLOATS:
        raise ValueError(f"{api}: {field}={value!r} is not a floating dtype parallax computes "
                         f"in; use one of {FLOATS} (a name or a jnp dtype).")
    return name


@dataclasses.dataclass(frozen=True)
class Policy:
    """Dtypes of a training step (see the module docstring); validated on creation.

    Args:
      params: storage dtype of the trained parameters (the master copy).
      compute: dtype of the forward and backward passes.
      grads: dtype of the gradients handed to the optimizer.
      reduce: dtype of the cross-device gradient sum (explicit style).
      loss_scale: ``"dynamic"`` (scale the loss, skip steps whose gradients overflow) or
        None; ``"default"`` is dynamic for float16 compute and None otherwise.

    Example:
      >>> Policy(compute="bfloat16").describe()
      'params=float32, compute=bfloat16, grads=float32, reduce=float32'
    """

    params: str = "float32"
    compute: str = "float32"
    grads: str = "float32"
    reduce: str = "float32"
    loss_scale: str | None = "default"

    def __post_init__(self):
        api = "px.MixedPrecision"
        for field in ("params", "compute", "grads", "reduce"):
            object.__setattr__(self, field, dtype_name(api, field, getattr(self, field)))
        scale = self.loss_scale
        if scale == "default":
            scale = "dynamic" if self.compute == "float16" else None
        if scale not in LOSS_SCALES:
            raise ValueError(f"{api}: loss_scale={self.loss_scale!r} must be 'dynamic' or None "
                             "(float16 compute defaults to 'dynamic').")
        object.__setattr__(self, "loss_scale", scale)

    def describe(self) -> str:
        return (f"params={self.params}, compute={self.compute}, grads={self.grads}, "
                f"reduce={self.reduce}")

    def to_compute(self, tree):
        """Floating leaves of ``tree`` cast to ``compute`` (integers, keys untouched)."""
        return cast_floating(tree, self.compute)

    def check_params(self, params, api: str) -> None:
        """Raises unless every floating parameter is stored in ``params``."""
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
            dtype = getattr(leaf, "dtype", None)
            if dtype is not None and jnp.issubdtype(dtype, jnp.floating) and \
                    jnp.dtype(dtype).name != self.params:
                raise TypeError(
                    f"{api}: parameter {readable_path(path)} is stored as "
                    f"{jnp.dtype(dtype).name}, but the precision policy ({self.describe()}) "
                    f"keeps parameters in {self.params}. Create the model with "
                    f"param_dtype={self.params} (the master copy), or set "
                    f"px.MixedPrecision(params={jnp.dtype(dtype).name!r}).")


def cast_floating(tree, dtype):
    """Every floating array leaf of ``tree`` cast to ``dtype``; other leaves unchanged.

    Example:
      >>> out = cast_floating({"w": jnp.ones(2), "n": jnp.int32(3)}, "bfloat16")
      >>> str(out["w"].dtype), str(out["n"].dtype)
      ('bfloat16', 'int32')
    """
    def cast(x):
        dtype_of = getattr(x, "dtype", None)
        if dtype_of is not None and jnp.issubdtype(dtype_of, jnp.floating):
            return jnp.asarray(x, dtype) if not isinstance(x, np.ndarray) else x.astype(dtype)
        return x

    return jax.tree.map(cast, tree)


ACCELERATORS = ("gpu", "cuda", "rocm", "tpu")


def default_compute_dtype(platform: str | None = None) -> str:
    """The compute dtype benchmarks and examples default to: ``"bfloat16"`` on a GPU or TPU
    (their matmul units' fast path; parameters and optimizer stay float32), ``"float32"``
    on CPU, where bfloat16 brings no speed and the tests compare float32 numbers.

    Args:
      platform: a ``jax.Device.platform`` (``"cpu"``, ``"gpu"``, ``"tpu"``, ...); None: the
        default backend's.

    Example:
      >>> default_compute_dtype("gpu"), default_compute_dtype("tpu"), default_compute_dtype("cpu")
      ('bfloat16', 'bfloat16', 'float32')
    """
    platform = jax.default_backend() if platform is None else platform
    return "bfloat16" if platform.lower() in ACCELERATORS else "float32"


PRECISIONS = {"fp32": "float32", "bf16": "bfloat16"}  # --precision's names


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds ``--precision auto|fp32|bf16`` (the examples' compute dtype) to a parser.

    ``auto`` is :func:`default_compute_dtype`: bf16 on a GPU or TPU, float32 on CPU;
    :func:`compute_dtype_from_flag` turns the choice into a dtype name.

    Example:
      >>> add_arguments(argparse.ArgumentParser()).parse_args(["--precision", "bf16"]).precision
      'bf16'
    """
    parser.add_argument("--precision", default="auto", choices=["auto", *PRECISIONS],
                        help="compute dtype; auto: bf16 on GPU/TPU, fp32 on CPU")
    return parser


def compute_dtype_from_flag(precision: str, platform: str | None = None) -> str:
    """``--precision``'s choice as a dtype name (``"auto"``: the platform's default).

    Example:
      >>> compute_dtype_from_flag("bf16"), compute_dtype_from_flag("auto", "tpu")
      ('bfloat16', 'bfloat16')
      >>> compute_dtype_from_flag("auto", "cpu")
      'float32'
      >>> compute_dtype_from_flag("fp16")
      Traceback (most recent call last):
      ValueError: parallax.precision.compute_dtype_from_flag: precision='fp16' is not one of
      'auto', 'fp32', 'bf16'.
    """
    if precision == "auto":
        return default_compute_dtype(platform)
    if precision not in PRECISIONS:
        raise ValueError(f"parallax.precision.compute_dtype_from_flag: precision={precision!r}"
                         f" is not one of 'auto', {', '.join(map(repr, PRECISIONS))}.")
    return PRECISIONS[precision]
