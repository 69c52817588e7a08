"""Commits of an elastic run: in memory on the node, and every few commits on disk.

Horovod's elastic ``State.commit()`` keeps a copy of the state in the workers' memory, so
that the survivors of a failure roll back to it instead of to the last checkpoint. JAX
processes share fate (a lost peer ends them all), so here a failure restarts the whole
group (``parallax launch --max-restarts``), and a commit must outlive the processes that
made it. ``parallax launch`` on one node therefore lends the job a directory in the node's
RAM (tmpfs, ``/dev/shm``; the ``PARALLAX_ELASTIC_MEMORY`` variable), which outlives every
restart and which the launcher removes when the job ends: each commit is an Orbax save
there (every process writes its shards, asynchronously, atomically; the newest is kept), and
every ``checkpoint_every``-th commit is also saved to ``directory`` on disk. A restarted
group restores the newest commit of either, on whatever number of processes it now has; a
job started again by hand (the launcher gone, its memory with it) restores from disk.

Example:
  >>> import tempfile, jax.numpy as jnp
  >>> commits = Commits(directory=tempfile.mkdtemp(), memory=None)
  >>> commits.save(1, {"w": jnp.ones(2)}, {"step": 4}); commits.wait()
  >>> commits.latest()
  (1, 'disk')
  >>> restored = commits.restore(like={"w": jnp.zeros(2)}, mesh=None, strategy=None)
  >>> restored.step, restored.extra, restored.state["w"].tolist()
  (1, {'step': 4}, [1.0, 1.0])
  >>> commits.close()
"""

from __future__ import annotations

import os

from parallax.checkpoint.manager import Manager
from parallax.checkpoint.restore import Restored

MEMORY_VARIABLE = "PARALLAX_ELASTIC_MEMORY"


def launcher_memory() -> str | None:
    """The directory in RAM that ``parallax launch`` lends this job (None outside one)."""
    return os.environ.get(MEMORY_VARIABLE) or None


class Commits:
    """Where an elastic run's commits go: memory (newest only) and, every few, disk.

    Args:
      directory: the durable checkpoint directory (None: memory only).
      memory: the directory in RAM (``launcher_memory()`` under the launcher; None: disk
        only).
      checkpoint_every: save every this many commits to ``directory``.
      keep: how many durable commits to keep (all when None).
    """

    def __init__(self, *, directory=None, memory: str | None = None, checkpoint_every: int = 1,
                 keep: int | None = None):
        self.memory = Manager(memory, max_to_keep=1) if memory else None
        self.disk = Manager(directory, max_to_keep=keep) if directory is not None else None
        self.checkpoint_every = checkpoint_every

    def places(self) -> dict[str, Manager]:
        return {name: m for name, m in (("memory", self.memory), ("disk", self.disk)) if m}

    def save(self, index: int, state, extra: dict) -> None:
        """Commit number ``index``: to memory, and to disk when it is due."""
        if self.memory is not None:
            self.memory.save(index, state, extra, force=True)
        if self.disk is not None and (self.memory is None or index % self.checkpoint_every == 0):
            self.disk.save(index, state, extra, force=True)

    def latest(self) -> tuple[int, str] | None:
        """``(index, "memory" | "disk")`` of the newest commit (memory wins a tie), or None."""
        found = [(m.latest_step(), -rank, name)
                 for rank, (name, m) in enumerate(self.places().items())
                 if m.latest_step() is not None]
        if not found:
            return None
        index, _, name = max(found)
        return index, name

    def restore(self, *, like, mesh, strategy) -> Restored:
        """The newest commit, laid out for ``mesh`` and ``strategy`` (as ``px.checkpoint``)."""
        self.wait()
        index, name = self.latest()
        return self.places()[name].restore(like=like, mesh=mesh, strategy=strategy, step=index)

    def wait(self) -> None:
        for manager in self.places().values():
            manager.wait()

    def close(self) -> None:
        for manager in self.places().values():
            manager.close()
