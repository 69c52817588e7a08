"""Starting a group's worker processes, and stopping them: all at once, reusing what a previous
group left, and, for a graceful shutdown, only once no call is in flight anywhere.

* **Start.** Every worker is a Ray actor (:class:`parallax.rpc.actor.RpcWorker`); all are
  asked to join at once, so their processes start in parallel. A worker process costs
  seconds to start (Python, Ray, JAX and parallax imported), so the driver keeps the
  processes of a group it shut down gracefully and the next ``init_rpc`` of the same
  process reuses them: each joins with a fresh state (no value, context or optimizer of the
  old group survives), as a PyTorch process may call ``init_rpc`` again after ``shutdown``.
  Module-level state of user code in those processes persists, as it does there.
* **Graceful stop.** Every worker (driver included) waits until it has no call in flight
  (made or served); the driver repeats the round until one in which no worker started a
  call, then the workers leave the group. So a call between two workers that is in flight
  when ``shutdown`` is called completes, and none is lost.

References:
  PyTorch, ``torch.distributed.rpc.api.shutdown`` (``_wait_all_workers``: every worker's
  outstanding work, then a barrier) and ``init_rpc`` after ``shutdown`` in one process.
"""

from __future__ import annotations

import time

import ray

from parallax.rpc.actor import RpcWorker
from parallax.rpc.agent import _CURRENT

RETIRE_TIMEOUT = 30.0  # seconds for idle workers to leave a group


def _job() -> tuple[str, str]:
    """This driver's Ray session (a job id repeats across clusters; a node id does not)."""
    context = ray.get_runtime_context()
    return context.get_node_id(), context.get_job_id()


def _take_idle(count: int) -> list:
    actors, job = _CURRENT.idle_workers
    actors = list(actors) if job == _job() else []  # another Ray session's are gone
    _CURRENT.idle_workers = (tuple(actors[count:]), _job())
    return actors[:count]


def start_workers(names: list[str], group_names: tuple, directory: str, options,
                  timeout: float | None) -> tuple[dict, dict]:
    """Actors for ``names`` (reused or new), joined; ``(actors, where)`` by name, ``where``
    being what each ``join`` returned (pid, node, socket path)."""
    for attempt in range(2):
        actors = dict(zip(names, _take_idle(len(names)) if attempt == 0 else []))
        actors.update({name: RpcWorker.remote() for name in names if name not in actors})
        refs = [actor.join.remote(name, group_names, directory, options)
                for name, actor in actors.items()]
        try:
            return actors, dict(zip(actors, ray.get(refs, timeout=timeout)))
        except ray.exceptions.RayActorError:  # a kept process had died: start new ones
            kill(actors.values())
            if attempt:
                raise
        except ray.exceptions.GetTimeoutError:
            kill(actors.values())
            raise RuntimeError(f"parallax.rpc.init_rpc: workers {names} did not start within "
                               f"{timeout} s (a loaded machine starts Python processes "
                               "slowly); pass a larger rpc_backend_options.rpc_timeout") from None
        except BaseException:
            kill(actors.values())
            raise
    raise AssertionError("unreachable")


def kill(actors) -> None:
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # gone already
            pass


def _report(ref) -> tuple[int, int]:
    try:
        return ray.get(ref)
    except ray.exceptions.RayError:  # a dead worker has nothing in flight
        return (0, 0)


def drain(agent, actors: dict, timeout: float | None) -> list[str]:
    """Waits until no worker has a call in flight and none started one in a full round;
    the workers still busy at ``timeout`` seconds (None: no limit), if any."""
    deadline = None if timeout is None else time.monotonic() + timeout
    previous = None
    while True:
        agent.activity.wait_idle(deadline)
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        reports = [_report(ref) for ref in [a.drain.remote(left) for a in actors.values()]]
        started = (agent.activity.started, *(report[0] for report in reports))
        busy = ([agent.name] if agent.activity.in_flight else []) + [
            name for name, report in zip(actors, reports) if report[1]]
        if not busy and started == previous:
            return []
        if deadline is not None and time.monotonic() >= deadline:
            return busy or list(actors)  # still starting calls: every worker is suspect
        previous = started


def stop_workers(actors: dict, keep: bool) -> None:
    """The workers leave the group; with ``keep``, the idle ones stay for the next group."""
    if not keep:
        kill(actors.values())
        return
    refs = {name: actor.retire.remote() for name, actor in actors.items()}
    kept = []
    for name, ref in refs.items():
        try:
            idle = ray.get(ref, timeout=RETIRE_TIMEOUT)
        except ray.exceptions.RayError:
            idle = False
        if idle:
            kept.append(actors[name])
        else:  # still running a call of the old group, or dead: not reused
            kill([actors[name]])
    previous, job = _CURRENT.idle_workers
    _CURRENT.idle_workers = ((*(previous if job == _job() else ()), *kept), _job())
