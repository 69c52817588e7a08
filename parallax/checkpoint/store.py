"""The Orbax ``CheckpointManager`` under every parallax checkpoint, and its directory.

A checkpoint directory holds one sub-directory per saved step, named by the step (``10/``),
each with two Orbax items: ``state`` (the arrays, Orbax's standard PyTree format, OCDBT) and
``extra`` (JSON). Orbax writes a step into ``<step>.orbax-checkpoint-tmp`` and renames it
when every item (and, across processes, every process) is done, so a step directory exists
only once it is complete; partial saves are never listed and are removed the next time a
writer opens the directory. Other files in the directory are left alone.

Example:
  >>> import tempfile
  >>> manager = open_manager(checkpoint_path(tempfile.mkdtemp(), "px.checkpoint.save"))
  >>> manager.all_steps()
  []
  >>> manager.close()
"""

from __future__ import annotations

import os

import numpy as np
import orbax.checkpoint as ocp
from etils import epath

ITEMS = ("state", "extra")


class CheckpointNotFoundError(FileNotFoundError, ValueError):
    """No checkpoint where one was asked for (a missing directory, step or item).

    Both a ``FileNotFoundError`` (what is missing is on disk) and a ``ValueError`` (the
    argument names nothing), so either ``except`` catches it.
    """


def checkpoint_path(directory, api: str) -> epath.Path:
    """``directory`` as an absolute path (local) or as given (``gs://...``)."""
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"{api}: directory must be a str or os.PathLike, got "
                        f"{type(directory).__name__}.")
    text = os.fspath(directory)
    if not text:
        raise ValueError(f"{api}: directory is empty; pass the checkpoint directory.")
    path = epath.Path(text if "://" in text else os.path.abspath(text))
    if path.exists() and not path.is_dir():
        raise ValueError(f"{api}: {path} is a file, not a directory; pass a directory "
                         "(it is created when missing).")
    return path


def check_step(step, api: str) -> int:
    """A step number: a non-negative int (NumPy integers too)."""
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
        raise TypeError(f"{api}: step must be an int, got {type(step).__name__}.")
    if step < 0:
        raise ValueError(f"{api}: step must be >= 0, got {step}.")
    return int(step)


def open_manager(path: epath.Path, *, read_only: bool = False, async_save: bool = False,
                 save_every: int = 1, max_to_keep: int | None = None) -> ocp.CheckpointManager:
    """An Orbax ``CheckpointManager`` for parallax's two items.

    Writers create the directory and remove Orbax's temporary directories of interrupted
    saves; readers (``read_only=True``) change nothing on disk.
    """
    policies = ocp.checkpoint_managers
    options = ocp.CheckpointManagerOptions(
        create=not read_only,
        cleanup_tmp_directories=not read_only,
        enable_async_checkpointing=async_save,
        save_decision_policy=policies.AnySavePolicy([
            policies.FixedIntervalPolicy(save_every),
            policies.PreemptionCheckpointingPolicy(),
        ]),
        preservation_policy=policies.LatestN(max_to_keep),
    )
    return ocp.CheckpointManager(
        path, options=options, item_names=ITEMS,
        item_handlers={"state": ocp.StandardCheckpointHandler(),
                       "extra": ocp.JsonCheckpointHandler()})


def step_directory(path: epath.Path, step: int) -> epath.Path:
    """Where step ``step`` lives (Orbax's default step names: the number)."""
    return path / str(step)
