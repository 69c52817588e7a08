"""``px.checkpoint.Manager``: periodic, asynchronous, atomic saves during training.

A thin layer over Orbax's ``CheckpointManager``: ``save(step, state, extra)`` every step of
a loop writes only every ``save_every`` steps; with ``async_save`` the arrays are handed to
Orbax (copied off the accelerator) and written by a background thread while training goes
on; ``max_to_keep`` removes the oldest steps, only after a newer one is complete. On CPU,
Orbax reads the arrays in place; JAX then declines to donate those buffers to the next step
until the write is done (it copies instead), so an asynchronous save never sees the next
step's values.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jax.sharding import Mesh

from parallax.checkpoint.restore import Restored, restore_from
from parallax.checkpoint.save import commit, save_args
from parallax.checkpoint.store import check_step, checkpoint_path, open_manager
from parallax.strategy import Strategy


def _count(value, name: str, api: str, *, allow_none: bool) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{api}: {name} must be an int{' or None' if allow_none else ''}, "
                        f"got {type(value).__name__}.")
    if value < 1:
        raise ValueError(f"{api}: {name} must be >= 1, got {value}.")
    return value


class Manager:
    """Saves a training state every ``save_every`` steps and restores the latest.

    Call :meth:`save` on every process, every step; it returns whether it saved. Use the
    manager as a context manager (or call :meth:`close`) so a pending asynchronous save
    finishes before the program exits; a process killed mid-save leaves the previous steps
    intact and the partial one ignored.

    Args:
      directory: the checkpoint directory (created when missing).
      max_to_keep: keep only the newest this many steps (all when None).
      save_every: save the steps that are multiples of this.
      async_save: write in a background thread (:meth:`wait` blocks until done).

    Example:
      >>> import tempfile, jax.numpy as jnp, optax, parallax as px
      >>> from flax import nnx
      >>> mesh, strategy = px.make_mesh(data=8), px.DataParallel("data")
      >>> make = lambda: px.TrainState.create(
      ...     px.models.MLP(4, [8], 4, rngs=nnx.Rngs(0)), optax.sgd(0.1))
      >>> @px.train_step(mesh, strategy)
      ... def step(state, batch):
      ...     loss, grads = px.value_and_grad(px.models.mse_loss)(state.model, batch)
      ...     return state.apply_gradients(grads), {"loss": loss}
      >>> batch = {"x": jnp.ones((8, 4)), "y": jnp.zeros((8, 4))}
      >>> with px.checkpoint.Manager(tempfile.mkdtemp(), max_to_keep=2, save_every=2) as ckpt:
      ...     state = px.init(make, mesh, strategy)
      ...     for i in range(1, 7):
      ...         state, _ = step(state, batch)
      ...         _ = ckpt.save(i, state, extra={"next_batch": i})
      ...     ckpt.wait()
      ...     steps = ckpt.all_steps()
      ...     restored = ckpt.restore(like=make, mesh=mesh, strategy=strategy)
      >>> steps, restored.step, int(restored.state.step)
      ([4, 6], 6, 6)

    References:
      Orbax ``CheckpointManager`` (save intervals, retention, async checkpointing);
      Check-N-Run (Eisenman et al., NSDI 2022) on overlapping checkpoints with training.
    """

    def __init__(self, directory, *, max_to_keep: int | None = None, save_every: int = 1,
                 async_save: bool = True):
        api = "px.checkpoint.Manager"
        self.path = checkpoint_path(directory, api)
        self.max_to_keep = _count(max_to_keep, "max_to_keep", api, allow_none=True)
        self.save_every = _count(save_every, "save_every", api, allow_none=False)
        self.async_save = bool(async_save)
        self._orbax = open_manager(self.path, async_save=self.async_save,
                                   save_every=self.save_every, max_to_keep=self.max_to_keep)

    def save(self, step: int, state, extra: Mapping[str, Any] | None = None, *,
             force: bool = False) -> bool:
        """Saves ``state`` and ``extra`` as ``step`` when ``step`` is due (or ``force``).

        A step is due when it is a multiple of ``save_every`` and newer than the latest
        saved one. With ``async_save`` this returns once the arrays are handed over; the
        previous asynchronous save, if any, is finished first.

        Returns:
          Whether a save was started.
        """
        api = "px.checkpoint.Manager.save"
        step = check_step(step, api)
        if not force and not self._orbax.should_save(step):
            return False
        commit(self._orbax, self.path, step, save_args(state, extra, api), api)
        return True

    def latest_step(self) -> int | None:
        """The newest step saved (or being saved asynchronously); None when there is none."""
        return self._orbax.latest_step()

    def all_steps(self) -> list[int]:
        """Every step kept, oldest first (including one being saved asynchronously)."""
        return sorted(self._orbax.all_steps())

    def restore(self, *, like, mesh: Mesh | None = None, strategy: Strategy | None = None,
                step: int | None = None) -> Restored:
        """``px.checkpoint.restore`` on this directory, after any pending save finishes."""
        self.wait()
        return restore_from(self._orbax, self.path, like=like, mesh=mesh, strategy=strategy,
                            step=step, api="px.checkpoint.Manager.restore")

    def wait(self) -> None:
        """Blocks until a pending asynchronous save is complete (committed on disk)."""
        self._orbax.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases Orbax's threads."""
        self._orbax.close()

    def __enter__(self) -> Manager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"px.checkpoint.Manager({str(self.path)!r}, max_to_keep={self.max_to_keep}, "
                f"save_every={self.save_every}, async_save={self.async_save})")
