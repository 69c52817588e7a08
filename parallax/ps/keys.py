"""Keys and key ranges: PS-Lite's sorted uint64 keys, one contiguous range per server.

PS-Lite splits the key space ``[0, kMaxKey)`` into as many contiguous ranges as there are
servers (``Postoffice::GetServerKeyRanges``); a request's sorted keys are then cut at the
range boundaries (``KVWorker::DefaultSlicer``) and each piece goes to its server. Everything
here is vectorised numpy: a request is sliced with one ``searchsorted`` over the boundaries,
never a Python loop over keys.
"""

from __future__ import annotations

import dataclasses

import numpy as np

MAX_KEY = int(np.iinfo(np.uint64).max)  # PS-Lite's kMaxKey


@dataclasses.dataclass(frozen=True)
class KeyRange:
    """The half-open key interval ``[begin, end)`` one server owns (PS-Lite's ``Range``).

    Example:
      >>> r = KeyRange(0, 10)
      >>> r.size, 3 in r, 10 in r
      (10, True, False)

    References:
      Li et al., "Scaling Distributed Machine Learning with the Parameter Server", OSDI 2014;
      PS-Lite's ``ps/range.h``.
    """

    begin: int
    end: int

    @property
    def size(self) -> int:
        """How many keys the range holds."""
        return self.end - self.begin

    def __contains__(self, key: int) -> bool:
        return self.begin <= int(key) < self.end


def server_key_ranges(num_servers: int, max_key: int = MAX_KEY) -> tuple[KeyRange, ...]:
    """Splits ``[0, max_key)`` into ``num_servers`` equal contiguous ranges, as PS-Lite does.

    Server ``i`` owns ``[max_key // n * i, max_key // n * (i + 1))``; the few keys above
    ``max_key // n * n`` belong to no server (PS-Lite's layout, kept so its key arithmetic
    carries over).

    Args:
      num_servers: how many servers share the key space (>= 1).
      max_key: the top of the key space (PS-Lite's ``kMaxKey``, 2**64 - 1).

    Returns:
      One :class:`KeyRange` per server, in server order.

    Example:
      >>> [(r.begin, r.end) for r in server_key_ranges(3, max_key=30)]
      [(0, 10), (10, 20), (20, 30)]

    References:
      PS-Lite, ``Postoffice::GetServerKeyRanges`` (``src/postoffice.cc``).
    """
    if not isinstance(num_servers, int) or isinstance(num_servers, bool):
        raise TypeError(f"server_key_ranges: num_servers must be an int, got "
                        f"{type(num_servers).__name__}: {num_servers!r}.")
    if num_servers < 1 or num_servers > max_key:
        raise ValueError(f"server_key_ranges: num_servers must be in [1, {max_key}], got "
                         f"{num_servers}.")
    width = max_key // num_servers
    return tuple(KeyRange(width * i, width * (i + 1)) for i in range(num_servers))


def check_keys(api: str, keys) -> np.ndarray:
    """``keys`` as a 1-D uint64 array, strictly increasing, or a clear error naming ``api``."""
    array = np.asarray(keys)
    if array.ndim != 1:
        raise ValueError(f"{api}: keys must be a 1-D array, got shape {array.shape}; "
                         f"flatten them (keys.ravel()).")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"{api}: keys must be integers (uint64), got dtype {array.dtype}.")
    if array.size and np.issubdtype(array.dtype, np.signedinteger) and array.min() < 0:
        raise ValueError(f"{api}: keys must be non-negative (uint64), got {array.min()}.")
    array = array.astype(np.uint64, copy=False)
    if array.size > 1 and not np.all(array[1:] > array[:-1]):
        bad = int(np.argmin(array[1:] > array[:-1]))
        raise ValueError(
            f"{api}: keys must be sorted and unique (PS-Lite's rule), but keys[{bad}] = "
            f"{array[bad]} is followed by {array[bad + 1]}; use np.unique(keys) and reorder "
            f"the values with it.")
    return array


def value_offsets(api: str, keys: np.ndarray, values: np.ndarray, lens) -> np.ndarray:
    """Where each key's values start and end in the flat ``values`` (``len(keys) + 1`` ints).

    Without ``lens`` every key has ``values.size // len(keys)`` values (PS-Lite's fixed
    length ``k``); with ``lens``, key ``i`` has ``lens[i]``.
    """
    if lens is None:
        if keys.size == 0:
            if values.size:
                raise ValueError(f"{api}: {values.size} values for no keys.")
            return np.zeros(1, np.int64)
        width, rest = divmod(values.size, keys.size)
        if rest:
            raise ValueError(
                f"{api}: {values.size} values do not split evenly over {keys.size} keys; "
                f"pass lens= (one length per key) for keys of different lengths.")
        return np.arange(keys.size + 1, dtype=np.int64) * width
    lens = np.asarray(lens)
    if lens.shape != keys.shape or (lens.size and not np.issubdtype(lens.dtype, np.integer)):
        raise ValueError(f"{api}: lens must hold one integer length per key: {keys.size} keys, "
                         f"lens of shape {lens.shape} and dtype {lens.dtype}.")
    if lens.size and lens.min() < 0:
        raise ValueError(f"{api}: lens must be non-negative, got {lens.min()}.")
    offsets = np.concatenate([[0], np.cumsum(lens, dtype=np.int64)])
    if offsets[-1] != values.size:
        raise ValueError(f"{api}: lens add up to {offsets[-1]} values but {values.size} "
                         f"were given.")
    return offsets


def slice_bounds(api: str, keys: np.ndarray, ranges: tuple[KeyRange, ...]) -> np.ndarray:
    """Positions cutting sorted ``keys`` into one piece per range (``len(ranges) + 1`` ints).

    Piece ``i`` is ``keys[bounds[i]:bounds[i + 1]]``. Keys outside every range are an error.

    Example:
      >>> ranges = server_key_ranges(2, max_key=100)
      >>> slice_bounds("demo", np.array([1, 7, 50, 99], np.uint64), ranges).tolist()
      [0, 2, 4]
    """
    if keys.size and (keys[0] < ranges[0].begin or keys[-1] >= ranges[-1].end):
        outside = keys[0] if keys[0] < ranges[0].begin else keys[-1]
        raise ValueError(
            f"{api}: key {outside} is outside every server's range [{ranges[0].begin}, "
            f"{ranges[-1].end}) ({len(ranges)} servers); keep keys below "
            f"{ranges[-1].end}.")
    begins = np.array([r.begin for r in ranges[1:]], np.uint64)
    inner = np.searchsorted(keys, begins, side="left")
    return np.concatenate([[0], inner, [keys.size]]).astype(np.int64)
