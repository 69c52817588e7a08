"""Horovod's elastic exceptions and ``hvd.elastic.ObjectState`` (small Python values).

``HorovodInternalError``: a collective failed; ``hvd.elastic.run`` restores the last commit
and calls the training function again. ``HostsUpdatedInterrupt``: the set of hosts changed;
``run`` syncs (unless ``skip_sync``) and calls it again, keeping the uncommitted state.
``ObjectState`` keeps keyword values as attributes, commits them in memory, restores them,
and syncs them from rank 0, as Horovod's (horovod/common/elastic.py).

Example:
  >>> import parallax.horovod as hvd
  >>> state = hvd.elastic.ObjectState(epoch=0, batch=0)
  >>> state.epoch = 3; state.commit()
  >>> state.epoch = 4; _ = state.restore(); state.epoch
  3

References:
  Horovod's horovod/common/elastic.py (``State``, ``ObjectState``, ``run_fn``) and
  horovod/common/exceptions.py.
"""

from __future__ import annotations

import copy
from collections.abc import Callable


class HorovodInternalError(RuntimeError):
    """A collective failed; ``hvd.elastic.run`` rolls back to the last commit and retries."""


class HostsUpdatedInterrupt(RuntimeError):
    """The hosts changed; ``hvd.elastic.run`` continues from the current (uncommitted) state.

    Args:
      skip_sync: True when hosts were only added (the state need not be re-broadcast).
    """

    def __init__(self, skip_sync: bool = False):
        super().__init__(f"hosts updated (skip_sync={skip_sync})")
        self.skip_sync = skip_sync


class ResetCallbacks:
    """The callbacks a state runs after a reset (a retry, or a restart on other processes)."""

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Calls each after a reset (rescale a learning rate, rebuild a data loader)."""
        self.__dict__.setdefault("_reset_callbacks", []).extend(callbacks)

    def on_reset(self) -> None:
        for callback in self.__dict__.get("_reset_callbacks", []):
            callback()

    def check_host_updates(self) -> None:
        """Horovod raises ``HostsUpdatedInterrupt`` here when its driver reported new or lost
        hosts. Hosts change here only by ``parallax launch`` restarting the group, so there is
        nothing to check in a running process."""


class ObjectState(ResetCallbacks):
    """Python values kept as attributes, committed in memory and synced from rank 0.

    Args:
      bcast_object: how to broadcast the values (``hvd.broadcast_object`` by default).
      get_rank: accepted for Horovod's signature.
      **kwargs: the values (``epoch=0, batch=0``), exposed as attributes.
    """

    def __init__(self, bcast_object=None, get_rank=None, **kwargs):
        del get_rank
        if bcast_object is None:
            from parallax.horovod.broadcast import broadcast_object as bcast_object
        self._bcast_object = bcast_object
        self._saved_state = copy.deepcopy(kwargs)
        self._set_attrs()

    def _set_attrs(self) -> None:
        for name, value in copy.deepcopy(self._saved_state).items():
            setattr(self, name, value)

    def save(self) -> None:
        """Copies the current values as the restore point."""
        self._saved_state = {name: copy.deepcopy(getattr(self, name))
                             for name in self._saved_state}

    def commit(self) -> None:
        """Saves, then checks for host updates (Horovod's ``State.commit``)."""
        self.save()
        self.check_host_updates()

    def restore(self) -> bool:
        """Puts back the last committed values (the ones given at construction at first)."""
        self._set_attrs()
        return True

    def sync(self) -> None:
        """Every process takes rank 0's committed values."""
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()
