"""``TF_CONFIG`` for the parameter-server strategy: ``chief``, ``worker`` and ``ps`` tasks.

TensorFlow's parameter-server training runs one process per task of ``TF_CONFIG``'s
cluster: the ``chief`` runs the ``ClusterCoordinator`` (the training program), and each
``worker`` and ``ps`` process starts a ``tf.distribute.Server`` and blocks in
``server.join()``. Here the chief's strategy starts one Ray actor per ``worker`` task and
one parameter server (a :class:`parallax.ps.KVStore` server) per ``ps`` task, so:

| TF_CONFIG task | TensorFlow's process | here |
|---|---|---|
| ``chief`` | creates the strategy and coordinator, runs the program | the same |
| ``worker`` i | ``Server(...).join()``: runs scheduled functions | Ray actor ``worker`` i, started by the chief; the process's :meth:`Server.join` returns at once |
| ``ps`` i | ``Server(...).join()``: holds variables | parameter-server actor i, started by the chief; the same |
| ``evaluator`` | side-car evaluation | a separate program (not part of the strategy) |

The ``host:port`` addresses are read and checked but not dialled: Ray places the actors
on its cluster (``address=`` is the Ray cluster's, for ``ray.init``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from parallax.tf.parameter_server.cluster_resolver import RayClusterResolver

_API = "px.tf.TFConfigClusterResolver"
_TASK_TYPES = ("chief", "worker", "ps", "evaluator")


class TFConfigClusterResolver(RayClusterResolver):
    """The job's shape from ``TF_CONFIG``: ``ps`` tasks become the parameter servers.

    Args:
      environ: where to read ``TF_CONFIG`` (default ``os.environ``).
      address: the Ray cluster's address (None: a local cluster on 127.0.0.1).
      worker_options: extra Ray actor options for the worker actors.

    Attributes:
      task_type, task_id: this process's task, as TensorFlow's resolver gives them.
      num_workers, num_ps: the number of ``worker`` and ``ps`` tasks (actors started).

    Example:
      >>> import json
      >>> config = {"cluster": {"chief": ["h0:2222"], "worker": ["h1:2222", "h2:2222"],
      ...                       "ps": ["h3:2222"]}, "task": {"type": "ps", "index": 0}}
      >>> resolver = TFConfigClusterResolver(environ={"TF_CONFIG": json.dumps(config)})
      >>> resolver.task_type, resolver.task_id, resolver.num_workers, resolver.num_ps
      ('ps', 0, 2, 1)

    References:
      TensorFlow, ``tf.distribute.cluster_resolver.TFConfigClusterResolver``
      (``tfconfig_cluster_resolver.py``) and the parameter-server training tutorial
      (``tf.distribute.Server(...).join()`` on workers and parameter servers).
    """

    def __init__(self, *, environ: Mapping[str, str] | None = None, address: str | None = None,
                 worker_options: dict | None = None):
        text = (os.environ if environ is None else environ).get("TF_CONFIG", "")
        cluster, task_type, task_id = _parse(text)
        object.__setattr__(self, "num_workers", len(cluster["worker"]))
        object.__setattr__(self, "num_ps", len(cluster["ps"]))
        object.__setattr__(self, "address", address)
        object.__setattr__(self, "worker_options", worker_options)
        object.__setattr__(self, "task_type", task_type)
        object.__setattr__(self, "task_id", task_id)
        object.__setattr__(self, "_cluster", {job: list(tasks) for job, tasks in cluster.items()})
        self.__post_init__()

    def cluster_spec(self) -> dict[str, list[str]]:
        """TF_CONFIG's cluster: task addresses by job (``ClusterSpec.as_dict()``)."""
        return {job: list(tasks) for job, tasks in self._cluster.items()}

    @property
    def rpc_layer(self) -> str:
        return "grpc"

    def __repr__(self) -> str:
        return (f"TFConfigClusterResolver(task={self.task_type}:{self.task_id}, "
                f"num_workers={self.num_workers}, num_ps={self.num_ps})")


class Server:
    """TensorFlow's ``tf.distribute.Server`` for a ``worker`` or ``ps`` task's process.

    The chief's strategy starts a Ray actor for every ``worker`` and ``ps`` task, so the
    process ``TF_CONFIG`` names for that task has nothing to host: :meth:`join` returns at
    once (TensorFlow's blocks forever), and a script written for TensorFlow
    (``if task_type in ("worker", "ps"): server.join() else: <coordinator>``) runs as is.
    It takes TensorFlow's arguments (``Server(resolver.cluster_spec(), job_name=...,
    task_index=..., protocol=..., start=True)``) or the resolver itself.

    Example:
      >>> import json
      >>> config = {"cluster": {"chief": ["h0:1"], "worker": ["h1:1"], "ps": ["h2:1"]},
      ...           "task": {"type": "worker", "index": 0}}
      >>> resolver = TFConfigClusterResolver(environ={"TF_CONFIG": json.dumps(config)})
      >>> Server(resolver).join()

    References:
      TensorFlow, ``tf.distribute.Server`` and the parameter-server training tutorial.
    """

    def __init__(self, server_or_cluster_def, job_name: str | None = None,
                 task_index: int | None = None, protocol: str | None = None, config=None,
                 start: bool = True):
        del protocol, config, start
        if isinstance(server_or_cluster_def, TFConfigClusterResolver):
            resolver = server_or_cluster_def
            job_name, task_index = resolver.task_type, resolver.task_id
        elif isinstance(server_or_cluster_def, Mapping):  # TF's Server(cluster_spec, ...)
            cluster = {job: list(tasks) for job, tasks in server_or_cluster_def.items()}
            resolver = TFConfigClusterResolver(environ={"TF_CONFIG": json.dumps(
                {"cluster": cluster, "task": {"type": job_name, "index": task_index}})})
        else:
            raise TypeError(f"px.tf.Server: pass this process's px.tf.TFConfigClusterResolver, "
                            f"or TensorFlow's arguments (resolver.cluster_spec(), "
                            f"job_name=, task_index=); got {type(server_or_cluster_def).__name__}.")
        if job_name not in ("worker", "ps"):
            raise ValueError(f"px.tf.Server: this process is task {job_name}:{task_index}; "
                             f"only worker and ps tasks start a server (the chief creates "
                             f"px.tf.ParameterServerStrategy).")
        self.resolver = resolver

    def start(self) -> None:
        """Nothing to start: the chief's strategy starts this task's Ray actor."""

    def join(self) -> None:
        """Returns at once: this task is played by a Ray actor the chief started."""


def _parse(text: str) -> tuple[dict, str, int]:
    def error(detail: str) -> ValueError:
        shown = text if len(text) <= 200 else text[:200] + "..."
        return ValueError(
            f"{_API}: TF_CONFIG {detail}. Expected JSON like {{\"cluster\": {{\"chief\": "
            f"[\"host:port\"], \"worker\": [\"host:port\", ...], \"ps\": [\"host:port\", "
            f"...]}}, \"task\": {{\"type\": \"ps\", \"index\": 0}}}}; got {shown!r}.")

    if not text:
        raise error("is not set")
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"is not valid JSON ({exc.msg} at position {exc.pos})") from None
    cluster = config.get("cluster") if isinstance(config, dict) else None
    if not isinstance(cluster, dict):
        raise error("has no 'cluster' mapping")
    unknown = sorted(set(cluster) - set(_TASK_TYPES))
    if unknown:
        raise error(f"has jobs {unknown}; the jobs are {list(_TASK_TYPES)}")
    for job, tasks in cluster.items():
        if not isinstance(tasks, list) or not all(isinstance(a, str) for a in tasks):
            raise error(f"job {job!r} is not a list of 'host:port' strings")
    for job in ("worker", "ps"):
        if not cluster.get(job):
            raise error(f"lists no {job!r} tasks; parameter-server training needs at least "
                        f"one worker and one ps")
    cluster.setdefault("chief", [])
    task = config.get("task")
    if not isinstance(task, dict) or "type" not in task or "index" not in task:
        raise error("has no 'task' with a 'type' and an 'index'")
    kind, index = task["type"], task["index"]
    if kind not in _TASK_TYPES:
        raise error(f"task type {kind!r} is not one of {list(_TASK_TYPES)}")
    if isinstance(index, bool) or not isinstance(index, int) or \
            not 0 <= index < len(cluster.get(kind, [])):
        raise error(f"task {kind}:{index!r} is not in the cluster, which lists "
                    f"{len(cluster.get(kind, []))} {kind} task(s)")
    return cluster, kind, index
