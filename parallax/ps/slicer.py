"""How a request's keys are split over the servers: PS-Lite's ``KVWorker::Slicer``.

A slicer is called as ``slicer(keys, ranges)`` with a request's sorted uint64 keys and the
servers' :class:`~parallax.ps.KeyRange`s, and returns one entry per server: the positions
(into ``keys``, increasing) of the keys that server gets, or None for none. The worker
checks the answer: every key goes to exactly one server, and that server's range holds it
(a server stores only its own range, and a pull must find the key where the push left it).
Since the servers' ranges are disjoint, a slicer that passes the check sends each key where
the default one would: a slicer ported from PS-Lite is checked against the store's ranges
rather than trusted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from parallax.ps.keys import KeyRange, slice_bounds

Slicer = Callable[[np.ndarray, Sequence[KeyRange]], Sequence]


def default_slicer(keys: np.ndarray, ranges: Sequence[KeyRange]) -> list[np.ndarray]:
    """The range partition: server ``i`` gets the keys inside ``ranges[i]``.

    Example:
      >>> from parallax.ps import server_key_ranges
      >>> parts = default_slicer(np.array([1, 60, 70], np.uint64), server_key_ranges(2, 100))
      >>> [p.tolist() for p in parts]
      [[0], [1, 2]]

    References:
      PS-Lite, ``KVWorker::DefaultSlicer`` (``include/ps/kv_app.h``).
    """
    bounds = slice_bounds("KVWorker", keys, tuple(ranges))
    return [np.arange(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]


def checked_bounds(api: str, slicer: Slicer, keys: np.ndarray,
                   ranges: tuple[KeyRange, ...]) -> np.ndarray:
    """The slicer's parts of ``keys`` as cut positions (``len(ranges) + 1`` ints), checked."""
    bounds = slice_bounds(api, keys, ranges)
    if slicer is default_slicer:
        return bounds
    parts = list(slicer(keys, ranges))
    if len(parts) != len(ranges):
        raise ValueError(f"{api}: the slicer returned {len(parts)} parts for {len(ranges)} "
                         f"servers; return one entry per server (None for no keys).")
    owner = np.full(keys.size, -1, np.int64)
    for server, part in enumerate(parts):
        positions = np.zeros(0, np.int64) if part is None else np.asarray(part)
        if positions.ndim != 1 or (positions.size and not np.issubdtype(positions.dtype,
                                                                         np.integer)):
            raise TypeError(f"{api}: the slicer's part for server {server} must be a 1-D array "
                            f"of integer positions into keys, got {positions.dtype} of shape "
                            f"{positions.shape}.")
        if positions.size and (positions.min() < 0 or positions.max() >= keys.size):
            raise ValueError(f"{api}: the slicer sent position {positions.max()} to server "
                             f"{server}, but the request has {keys.size} keys.")
        begin, end = ranges[server].begin, ranges[server].end
        outside = (keys[positions] < np.uint64(begin)) | (keys[positions] >= np.uint64(end))
        if outside.any():
            key = keys[positions[int(np.argmax(outside))]]
            raise ValueError(f"{api}: the slicer sent key {key} to server {server}, whose "
                             f"range [{begin}, {end}) does not hold it; send each key to the "
                             f"server whose range holds it (store.server_key_ranges()).")
        twice = owner[positions] >= 0
        if twice.any():
            raise ValueError(f"{api}: the slicer sent key {keys[positions[int(np.argmax(twice))]]}"
                             f" to more than one server; each key goes to exactly one.")
        owner[positions] = server
    if (owner < 0).any():
        raise ValueError(f"{api}: the slicer lost key {keys[int(np.argmax(owner < 0))]} (it is "
                         f"in no server's part); every key of the request must be sent.")
    return bounds
