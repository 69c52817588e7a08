"""Where the parameter-server job runs: how many workers and servers, on which Ray cluster."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class RayClusterResolver:
    """The shape of a parameter-server job on Ray (TensorFlow's cluster resolver, for Ray).

    TensorFlow names its tasks ``chief``, ``worker`` and ``ps``; here the chief is the
    process that creates the strategy and the coordinator, and workers and parameter
    servers are Ray actors it starts on the cluster.

    Args:
      num_workers: worker actors (run scheduled functions).
      num_ps: parameter-server actors (hold the variables).
      address: None for a local Ray cluster on 127.0.0.1 (started if needed); otherwise
        a running cluster's address, for ``ray.init(address=...)``.
      worker_options: extra Ray actor options for the workers, e.g. ``{"num_gpus": 1}``.

    Example:
      >>> resolver = RayClusterResolver(num_workers=2, num_ps=1)
      >>> resolver.cluster_spec()
      {'chief': ['chief:0'], 'worker': ['worker:0', 'worker:1'], 'ps': ['ps:0']}

    References:
      TensorFlow, ``tf.distribute.cluster_resolver.ClusterResolver`` and
      ``SimpleClusterResolver``.
    """

    num_workers: int = 2
    num_ps: int = 1
    address: str | None = None
    worker_options: dict[str, Any] | None = None

    def __post_init__(self):
        for name in ("num_workers", "num_ps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"px.tf.RayClusterResolver: {name} must be an int, got "
                                f"{type(value).__name__}: {value!r}.")
            if value < 1:
                raise ValueError(f"px.tf.RayClusterResolver: {name} must be >= 1, got {value}.")

    def cluster_spec(self) -> dict[str, list[str]]:
        """Task names by job, as TensorFlow's ``ClusterSpec.as_dict()`` lists them."""
        return {"chief": ["chief:0"],
                "worker": [f"worker:{i}" for i in range(self.num_workers)],
                "ps": [f"ps:{i}" for i in range(self.num_ps)]}
