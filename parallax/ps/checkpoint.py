"""Checkpoints of parameter servers: each server writes its own shard with Orbax.

A server's state is arrays only (keys, offsets, values, the handle's state leaves, the
vector clock), so it is saved as an Orbax pytree of arrays: no pickles are written or read.
Each server writes ``<directory>/server-<rank>`` itself, so no process ever holds the whole
store; on a multi-machine cluster ``directory`` must be storage every server can reach
(a shared filesystem, or a ``gs://`` path Orbax understands).
"""

from __future__ import annotations

import pathlib

import numpy as np
import orbax.checkpoint as ocp


def server_path(directory, rank: int) -> pathlib.Path:
    """Where server ``rank``'s shard of a checkpoint lives.

    Example:
      >>> server_path("/tmp/ckpt", 1).as_posix()
      '/tmp/ckpt/server-1'
    """
    return pathlib.Path(directory).absolute() / f"server-{rank}"


def _pad(array: np.ndarray) -> np.ndarray:
    """1-D arrays gain one trailing element: Orbax refuses empty arrays (a server with no keys)."""
    array = np.asarray(array)
    return np.append(array, np.zeros(1, array.dtype)) if array.ndim == 1 else array


def _unpad(array) -> np.ndarray:
    array = np.asarray(array)
    return array[:-1] if array.ndim == 1 else array


def save_snapshot(path: pathlib.Path, snapshot: dict) -> None:
    """Writes one server's :meth:`~parallax.ps.server.KVServer.snapshot` (blocking)."""
    tree = {name: _pad(value) for name, value in snapshot.items() if name != "state"}
    tree["state"] = {str(i): _pad(leaf) for i, leaf in enumerate(snapshot["state"])}
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, tree)


def load_snapshot(path: pathlib.Path) -> dict:
    """Reads what :func:`save_snapshot` wrote, or a clear error if it is missing."""
    if not path.exists():
        raise FileNotFoundError(f"KVStore.restore: no server checkpoint at {path}; the "
                                f"directory must come from KVStore.save with the same number "
                                f"of servers.")
    with ocp.StandardCheckpointer() as checkpointer:
        tree = checkpointer.restore(path)
    state = tree.get("state") or {}
    snapshot = {name: _unpad(value) for name, value in tree.items() if name != "state"}
    snapshot["state"] = [_unpad(state[str(i)]) for i in range(len(state))]
    return snapshot
