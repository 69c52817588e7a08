"""``extra``: what a resume needs besides the state, stored as JSON next to it.

A data iterator's position, a NumPy generator's state, an RNG key, the step counter, a
run's configuration: small values, saved with Orbax's JSON handler. JSON types pass through;
NumPy and JAX arrays (and NumPy scalars) become tagged lists and come back as NumPy arrays of
the same dtype and shape, and typed JAX PRNG keys (``jax.random.key``) come back as keys of
the same implementation, so a resumed run draws the same numbers. Anything else is refused
at save time with its path. Mapping keys must be strings (JSON would turn ``1`` into
``"1"``); tuples come back as lists.

Example:
  >>> import numpy as np
  >>> extra = {"position": 3, "rng": np.random.default_rng(0).bit_generator.state}
  >>> decode(encode(extra, "px.checkpoint.save")) == extra
  True
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

ARRAY = "__parallax_array__"
KEY = "__parallax_prng_key__"


def _is_key(value) -> bool:
    return isinstance(value, jax.Array) and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key)


def _array(value) -> dict:
    array = np.asarray(value)
    return {ARRAY: {"dtype": str(array.dtype), "shape": list(array.shape),
                    "data": array.ravel().tolist()}}


def encode(value: Any, api: str, where: str = "extra") -> Any:
    """``value`` as JSON-compatible data (see the module docstring); raises on other kinds."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{api}: {where} has the key {key!r} ({type(key).__name__}); "
                                "keys of extra must be strings (JSON).")
            out[key] = encode(item, api, f"{where}[{key!r}]")
        return out
    if isinstance(value, (list, tuple)):
        return [encode(item, api, f"{where}[{i}]") for i, item in enumerate(value)]
    if _is_key(value):
        return {KEY: {"impl": str(jax.random.key_impl(value)),
                      "data": _array(jax.random.key_data(value))}}
    if isinstance(value, (np.ndarray, np.generic, jax.Array)):
        return _array(value)
    raise TypeError(
        f"{api}: {where} is a {type(value).__name__}; extra holds JSON values (dict with "
        "string keys, list, str, int, float, bool, None), NumPy or JAX arrays and JAX PRNG "
        "keys. Save a generator's state (np.random.Generator.bit_generator.state), not "
        "the generator; put large arrays in the state.")


def decode(value: Any) -> Any:
    """Inverse of :func:`encode`."""
    if isinstance(value, Mapping):
        if set(value) == {ARRAY}:
            spec = value[ARRAY]
            return np.asarray(spec["data"], dtype=spec["dtype"]).reshape(spec["shape"])
        if set(value) == {KEY}:
            spec = value[KEY]
            return jax.random.wrap_key_data(decode(spec["data"]), impl=spec["impl"])
        return {key: decode(item) for key, item in value.items()}
    if isinstance(value, list):
        return [decode(item) for item in value]
    return value
