"""Horovod's elastic training: ``hvd.elastic.State`` and ``@hvd.elastic.run``.

    import parallax.horovod as hvd

    hvd.init()
    mesh = px.make_mesh(data=-1)                      # every device of the processes there are
    state = hvd.elastic.State(px.init(make_state, mesh, strategy), like=make_state,
                              mesh=mesh, strategy=strategy, directory="runs/x", step=0)

    @hvd.elastic.run
    def train(state):
        while state.step < steps:
            rows = px.distributed.process_slice(GLOBAL_BATCH, mesh, strategy)
            batch = px.distributed.global_batch(load(state.step)[rows], mesh, strategy)
            state.train_state, _ = step(state.train_state, batch)
            state.step += 1
            if state.step % 10 == 0:
                state.commit()

    train(state)

run with ``parallax launch -np 4 --max-restarts 3 --min-np 2 python train.py``. In Horovod
the surviving workers of a failure stay up, roll back to their last commit in memory, and
re-form the ring. JAX processes share fate, so here the launcher restarts the group (with
fewer processes when slots are lost, down to ``--min-np``) and ``run`` resumes it from the
newest commit: kept in the node's RAM by the launcher, else the newest on disk
(``parallax.checkpoint.elastic``). Commits are ``px.checkpoint`` saves, so a commit made by
N processes restores on M, in the layout of the mesh the restarted program builds. With the
global batch fixed (each process loading ``process_slice(GLOBAL_BATCH, ...)`` of it), the
resumed run computes what the uninterrupted one would have.

Within one group, ``run`` retries as Horovod's ``run_fn`` does: on ``HorovodInternalError``
it restores the last commit and calls the function again; on ``HostsUpdatedInterrupt`` it
syncs (unless ``skip_sync``) and calls it again from the current state; after each, the
reset callbacks run. What remains a restart of the whole group: Horovod re-forms its ring
in-process after a lost worker (``hvd.shutdown(); hvd.init()``), while ``jax.distributed``
cannot re-form a group in a running process, so a failure of the group itself (a peer
killed: its collectives fail, the coordination service aborts) ends the processes, and the
launcher restarts them from the newest commit. The in-process retry serves errors every
process raises together (a step that detects a bad batch or a non-finite loss and raises
``HorovodInternalError`` on every rank), and ``HostsUpdatedInterrupt`` raised by the program.
``hvd.elastic.ObjectState`` (small Python values committed in memory) works with both.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import jax

from parallax.checkpoint.elastic import Commits, launcher_memory
from parallax.checkpoint.store import checkpoint_path
from parallax.horovod.broadcast import broadcast_object
from parallax.horovod.elastic_state import HorovodInternalError as HorovodInternalError
from parallax.horovod.elastic_state import HostsUpdatedInterrupt as HostsUpdatedInterrupt
from parallax.horovod.elastic_state import ObjectState as ObjectState
from parallax.horovod.elastic_state import ResetCallbacks

API = "hvd.elastic.State"


class State(ResetCallbacks):
    """A training state and the values a resume needs, committed and restored together.

    Args:
      train_state: the arrays (``px.TrainState``, ``(params, opt_state)``...), as built for
        ``mesh`` and ``strategy``.
      like: the function given to ``px.init`` (or an abstract state), to restore commits.
      mesh, strategy: the layout of ``train_state`` (where commits are restored to).
      directory: where commits are also saved on disk (needed outside ``parallax launch``
        on one node, where commits have no memory to live in).
      checkpoint_every: save every this many commits to ``directory`` (when commits live in
        memory too; otherwise every commit).
      keep: how many commits to keep on disk (all when None).
      **attrs: small values that travel with the state (``step``, ``epoch``, ``batch``):
        plain attributes, saved as JSON with every commit.

    Example:
      >>> import tempfile, optax, parallax as px, parallax.horovod as hvd
      >>> from flax import nnx
      >>> make = lambda: px.TrainState.create(
      ...     px.models.MLP(4, [8], 4, rngs=nnx.Rngs(0)), optax.sgd(0.1))
      >>> mesh = px.make_mesh(data=8)
      >>> state = hvd.elastic.State(px.init(make, mesh), like=make, mesh=mesh,
      ...                           directory=tempfile.mkdtemp(), step=0)
      >>> state.step = 5; state.commit()
      >>> state.step = 7
      >>> state.restore(), state.step
      (True, 5)

    References:
      Sergeev and Del Balso, Horovod (2018), and Horovod's elastic training
      (``hvd.elastic.run``, ``State.commit/restore/sync``).
    """

    def __init__(self, train_state, *, like, mesh, strategy=None, directory=None,
                 checkpoint_every: int = 1, keep: int | None = None, **attrs):
        memory = launcher_memory()
        if directory is None and memory is None:
            raise ValueError(
                f"{API}: commits need somewhere to live: pass directory= (a checkpoint "
                "directory every process can reach), or run under parallax launch on one "
                "node, which keeps commits in the node's memory.")
        if directory is not None:
            checkpoint_path(directory, API)
        self.train_state = train_state
        self._like, self._mesh, self._strategy = like, mesh, strategy
        self._names = tuple(attrs)
        for name, value in attrs.items():
            setattr(self, name, value)
        self._commits = Commits(directory=directory, memory=memory,
                                checkpoint_every=checkpoint_every, keep=keep)
        self._commit = 0
        self.resumed = None  # (commit, where, processes that made it) after a restore

    def attrs(self) -> dict:
        """The committed values besides the arrays, by name."""
        return {name: getattr(self, name) for name in self._names}

    def commit(self) -> None:
        """Saves the arrays and the values as the restore point (asynchronously, atomically)."""
        self._commit += 1
        self._commits.save(self._commit, self.train_state,
                           {"attrs": self.attrs(), "processes": jax.process_count()})

    def restore(self) -> bool:
        """Rolls back to the newest commit (memory, else disk); False when there is none."""
        latest = self._commits.latest()
        if latest is None:
            return False
        restored = self._commits.restore(like=self._like, mesh=self._mesh,
                                         strategy=self._strategy)
        self.train_state, self._commit = restored.state, restored.step
        for name, value in restored.extra["attrs"].items():
            setattr(self, name, value)
        self.resumed = (restored.step, latest[1], restored.extra["processes"])
        return True

    def sync(self) -> None:
        """Every process takes process 0's values (the arrays are global: one value already)."""
        for name, value in broadcast_object(self.attrs(), 0).items():
            setattr(self, name, value)

    def wait(self) -> None:
        """Blocks until every commit started is written."""
        self._commits.wait()

    def close(self) -> None:
        self._commits.close()


def _processes(count: int) -> str:
    return f"{count} process{'es' if count > 1 else ''}"


def run(func: Callable | None = None, *, reset_limit: int | None = None) -> Callable:
    """Runs ``func(state, ...)`` from the newest commit, retrying as Horovod's ``hvd.elastic.run``.

    Before the first call, for a :class:`State`, it restores the newest commit if there is
    one (after a restart by ``parallax launch --max-restarts``, or a job started again by
    hand), says so on process 0, and runs the reset callbacks when the number of processes
    changed. Then, as Horovod's ``run_fn``: sync the state from rank 0 and call ``func``; on
    ``HorovodInternalError`` restore the last commit and call again; on
    ``HostsUpdatedInterrupt`` call again from the current state (syncing unless
    ``skip_sync``); after either, the reset callbacks run. After ``func`` returns it waits for
    the commits to be written. Any other error ends the process (the launcher restarts the
    group: see the module's notes).

    Args:
      func: the training function; its first argument is the state.
      reset_limit: retries allowed in this process (None: no limit); one more raises.

    Returns:
      The wrapped function.

    Example:
      >>> import parallax.horovod as hvd
      >>> state, attempts = hvd.elastic.ObjectState(step=0), []
      >>> @hvd.elastic.run
      ... def train(state):
      ...     attempts.append(state.step)
      ...     state.step += 1
      ...     if len(attempts) == 1:
      ...         raise hvd.HorovodInternalError("a failed collective")  # back to step 0
      ...     return state.step
      >>> train(state), attempts
      (1, [0, 0])
    """
    if func is None:
        return functools.partial(run, reset_limit=reset_limit)

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        if isinstance(state, State) and state.restore():
            commit, where, processes = state.resumed
            if jax.process_index() == 0:
                print(f"parallax elastic: restart {os.environ.get('PARALLAX_RESTART', '0')} "
                      f"on {_processes(jax.process_count())}: resumed from commit {commit} "
                      f"({where}, made by {_processes(processes)}) at {state.attrs()}", flush=True)
            if processes != jax.process_count():
                state.on_reset()
        skip_sync, resets = False, 0
        while True:
            try:
                if not skip_sync:
                    state.sync()
                result = func(state, *args, **kwargs)
                break
            except HorovodInternalError:
                state.restore()
                skip_sync = False
            except HostsUpdatedInterrupt as interrupt:
                skip_sync = interrupt.skip_sync
            resets += 1
            if reset_limit is not None and resets > reset_limit:
                raise RuntimeError(f"hvd.elastic.run: {resets} resets in this process, over "
                                   f"reset_limit={reset_limit}.")
            state.on_reset()
        if isinstance(state, State):
            state.close()
        return result

    return wrapper
