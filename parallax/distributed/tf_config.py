"""``TF_CONFIG``: TensorFlow's cluster spec and task, read as a :class:`ClusterSpec`.

TF's runtime maps onto JAX's as: the chief (or worker 0 without a chief) is process 0 and
hosts the coordinator at its own address; the chief then the workers are the processes, in
that order; ``ps`` and ``evaluator`` tasks are not part of an SPMD job.

Example:
  >>> import json
  >>> config = {"cluster": {"worker": ["a:1", "a:2"]}, "task": {"type": "worker", "index": 1}}
  >>> spec = from_tf_config({"TF_CONFIG": json.dumps(config)})
  >>> spec.coordinator, spec.num_processes, spec.process_id, spec.local_rank
  ('a:1', 2, 1, 1)
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from parallax.distributed.cluster import API, ClusterSpec, check_address

def _tf_config_error(detail: str, text: str) -> ValueError:
    shown = text if len(text) <= 200 else text[:200] + "..."
    return ValueError(
        f"{API}: TF_CONFIG {detail}. Expected JSON like {{\"cluster\": {{\"chief\": "
        f"[\"host:port\"], \"worker\": [\"host:port\", ...]}}, \"task\": {{\"type\": "
        f"\"worker\", \"index\": 0}}}}; got {shown!r}."
    )


def from_tf_config(env: Mapping[str, str]) -> ClusterSpec | None:
    """TensorFlow's ``TF_CONFIG``: the chief then the workers are the processes.

    TF's runtime maps onto JAX's as: the chief (or worker 0) -> process 0, which hosts the
    coordinator at its own address; each worker -> one process; ``ps`` and ``evaluator``
    tasks are not part of an SPMD job.
    """
    text = env.get("TF_CONFIG")
    if not text:
        return None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise _tf_config_error(f"is not valid JSON ({error.msg} at position {error.pos})",
                               text) from None
    if not isinstance(config, dict) or not isinstance(config.get("cluster"), dict):
        raise _tf_config_error("has no 'cluster' mapping", text)
    task = config.get("task")
    if not isinstance(task, dict) or "type" not in task or "index" not in task:
        raise _tf_config_error("has no 'task' with a 'type' and an 'index'", text)
    cluster, kind, index = config["cluster"], task["type"], task["index"]
    if kind in ("ps", "evaluator"):
        raise ValueError(
            f"{API}: TF_CONFIG task type {kind!r} is not a process of an SPMD job (only chief "
            "and worker tasks are); run parameter servers with parallax.ps / parallax.tf "
            "(Ray), and evaluators as a separate program."
        )
    processes = [("chief", a) for a in cluster.get("chief", [])] + [
        ("worker", a) for a in cluster.get("worker", [])]
    if not processes:
        raise _tf_config_error("lists no 'chief' or 'worker' tasks", text)
    for kind_name, address in processes:
        if not isinstance(address, str):
            raise _tf_config_error(f"has a {kind_name} address that is not a string", text)
        check_address(address, f"TF_CONFIG {kind_name} address")
    if kind not in ("chief", "worker"):
        raise _tf_config_error(f"task type {kind!r} is not 'chief' or 'worker'", text)
    if isinstance(index, bool) or not isinstance(index, int):
        raise _tf_config_error(f"task index {index!r} is not an integer", text)
    count = len(cluster.get(kind, []))
    if not 0 <= index < count:
        raise ValueError(
            f"{API}: TF_CONFIG task {kind}:{index} is not in the cluster spec, which lists "
            f"{count} {kind} task(s) (indices 0 .. {count - 1}); rank {index} is not below "
            f"world size {count}."
        )
    process_id = index if kind == "chief" else len(cluster.get("chief", [])) + index
    host = processes[process_id][1].rpartition(":")[0]
    same_host = [i for i, (_, a) in enumerate(processes) if a.rpartition(":")[0] == host]
    return ClusterSpec(
        coordinator=processes[0][1],
        num_processes=len(processes),
        process_id=process_id,
        local_rank=same_host.index(process_id),
        local_size=len(same_host),
        source="TF_CONFIG",
    )
