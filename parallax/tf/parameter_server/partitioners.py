"""Variable partitioners of TensorFlow's ParameterServerStrategy: how many shards, along axis 0.

A partitioner maps a variable's ``(shape, dtype)`` to the number of partitions per axis, only
axis 0 above 1. ``shard_rows`` then splits the rows as TensorFlow does: when the shards do
not divide the rows, the first ones take one row more.
"""

from __future__ import annotations

import abc
import math

import numpy as np


def _element_bytes(dtype, bytes_per_string: int) -> int:
    dtype = np.dtype(dtype)
    return bytes_per_string if dtype.kind in "OSU" else dtype.itemsize


def _check_shape(api: str, shape) -> tuple[int, ...]:
    shape = tuple(int(d) for d in shape)
    if not shape:
        raise ValueError(f"{api}: a scalar variable cannot be partitioned (shape ()); "
                         f"partitioners act on axis 0.")
    if shape[0] < 1:
        raise ValueError(f"{api}: axis 0 of shape {shape} is empty; nothing to partition.")
    return shape


def _positive(api: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{api}: {name} must be an int, got {type(value).__name__}: {value!r}.")
    if value < 1:
        raise ValueError(f"{api}: {name} must be positive, got {value}.")
    return value


class Partitioner(abc.ABC):
    """Base class: ``partitioner(shape, dtype) -> [shards, 1, 1, ...]``.

    Example:
      >>> FixedShardsPartitioner(2)((10, 4), np.float32)
      [2, 1]

    References:
      TensorFlow, ``tf.distribute.experimental.partitioners.Partitioner``.
    """

    @abc.abstractmethod
    def __call__(self, shape, dtype) -> list[int]:
        """The number of partitions per axis of a variable of ``shape`` and ``dtype``."""


class FixedShardsPartitioner(Partitioner):
    """``num_shards`` shards (fewer if axis 0 has fewer rows).

    Args:
      num_shards: the number of shards.

    Example:
      >>> FixedShardsPartitioner(4)((3, 2), np.float32)
      [3, 1]
      >>> FixedShardsPartitioner(2)((10,), np.float32)
      [2]

    References:
      TensorFlow, ``tf.distribute.experimental.partitioners.FixedShardsPartitioner``.
    """

    def __init__(self, num_shards: int):
        self.num_shards = _positive("px.tf.FixedShardsPartitioner", "num_shards", num_shards)

    def __call__(self, shape, dtype) -> list[int]:
        shape = _check_shape("px.tf.FixedShardsPartitioner", shape)
        return [min(self.num_shards, shape[0])] + [1] * (len(shape) - 1)

    def __repr__(self) -> str:
        return f"FixedShardsPartitioner({self.num_shards})"


class MinSizePartitioner(Partitioner):
    """As many shards as keep each at least ``min_shard_bytes``, at most ``max_shards``.

    The count is ``ceil(total_bytes / min_shard_bytes)``, bounded by ``max_shards`` and the
    rows (TensorFlow's ``min_max_variable_partitioner``).

    Args:
      min_shard_bytes: the smallest shard wanted (default 256 KiB).
      max_shards: the most shards (default 1).
      bytes_per_string: the assumed size of one string element.

    Example:
      >>> MinSizePartitioner(min_shard_bytes=4, max_shards=2)((6, 1), np.float32)
      [2, 1]
      >>> MinSizePartitioner(min_shard_bytes=4, max_shards=10)((6, 1), np.float32)
      [6, 1]

    References:
      TensorFlow, ``tf.distribute.experimental.partitioners.MinSizePartitioner``.
    """

    def __init__(self, min_shard_bytes: int = 256 << 10, max_shards: int = 1,
                 bytes_per_string: int = 16):
        api = "px.tf.MinSizePartitioner"
        self.min_shard_bytes = _positive(api, "min_shard_bytes", min_shard_bytes)
        self.max_shards = _positive(api, "max_shards", max_shards)
        self.bytes_per_string = _positive(api, "bytes_per_string", bytes_per_string)

    def __call__(self, shape, dtype) -> list[int]:
        shape = _check_shape("px.tf.MinSizePartitioner", shape)
        total = math.prod(shape) * _element_bytes(dtype, self.bytes_per_string)
        shards = max(1, min(shape[0], self.max_shards, math.ceil(total / self.min_shard_bytes)))
        return [shards] + [1] * (len(shape) - 1)

    def __repr__(self) -> str:
        return (f"MinSizePartitioner(min_shard_bytes={self.min_shard_bytes}, "
                f"max_shards={self.max_shards})")


class MaxSizePartitioner(Partitioner):
    """As few shards as keep each at most ``max_shard_bytes`` (at least one row per shard).

    Args:
      max_shard_bytes: the largest shard wanted.
      max_shards: an upper bound on the shards (None: no bound; then shards may exceed
        ``max_shard_bytes``).
      bytes_per_string: the assumed size of one string element.

    Example:
      >>> MaxSizePartitioner(max_shard_bytes=4)((6, 1), np.float32)
      [6, 1]
      >>> MaxSizePartitioner(max_shard_bytes=4, max_shards=2)((6, 1), np.float32)
      [2, 1]
      >>> MaxSizePartitioner(max_shard_bytes=1024)((6, 1), np.float32)
      [1, 1]

    References:
      TensorFlow, ``tf.distribute.experimental.partitioners.MaxSizePartitioner``.
    """

    def __init__(self, max_shard_bytes: int, max_shards: int | None = None,
                 bytes_per_string: int = 16):
        api = "px.tf.MaxSizePartitioner"
        self.max_shard_bytes = _positive(api, "max_shard_bytes", max_shard_bytes)
        self.max_shards = None if max_shards is None else _positive(api, "max_shards", max_shards)
        self.bytes_per_string = _positive(api, "bytes_per_string", bytes_per_string)

    def __call__(self, shape, dtype) -> list[int]:
        shape = _check_shape("px.tf.MaxSizePartitioner", shape)
        row_bytes = math.prod(shape[1:]) * _element_bytes(dtype, self.bytes_per_string)
        rows_per_shard = max(1, math.floor(self.max_shard_bytes / row_bytes))
        shards = math.ceil(shape[0] / rows_per_shard)
        if self.max_shards:
            shards = min(self.max_shards, shards)
        return [shards] + [1] * (len(shape) - 1)

    def __repr__(self) -> str:
        return (f"MaxSizePartitioner(max_shard_bytes={self.max_shard_bytes}, "
                f"max_shards={self.max_shards})")


def shard_rows(rows: int, num_shards: int) -> list[int]:
    """Rows of each shard: equal, the first ``rows % num_shards`` shards one row longer.

    Example:
      >>> shard_rows(10, 3)
      [4, 3, 3]

    References:
      TensorFlow's partitioned variables (``variable_scope._get_partitioned_variable``).
    """
    base, extra = divmod(rows, num_shards)
    return [base + (1 if i < extra else 0) for i in range(num_shards)]
