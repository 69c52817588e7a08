"""torchrun's worker variables, exported by ``parallax launch`` with torchrun's meanings.

Scripts, data loaders and loggers written for torchrun read ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; ``parallax launch``
sets them (and the rest of what torchrun's agent sets) beside its own ``PARALLAX_*``.
"""

from __future__ import annotations

from collections.abc import Sequence

#: torchrun's variables, as its agent sets them for each worker
#: (torch/distributed/elastic/agent/server/local_elastic_agent.py, ``_start_workers``), with
#: what they hold under ``parallax launch``. One role, so ROLE_* equal the global numbers.
TORCHRUN_EXPORTS = {
    "RANK": "the global rank (= PARALLAX_PROCESS_ID)",
    "LOCAL_RANK": "the rank on this node (= PARALLAX_LOCAL_RANK)",
    "WORLD_SIZE": "processes in the job (= PARALLAX_NUM_PROCESSES)",
    "LOCAL_WORLD_SIZE": "processes on this node (= PARALLAX_LOCAL_SIZE)",
    "GROUP_RANK": "this node's index (torchrun's agent group rank; = PARALLAX_NODE_RANK)",
    "GROUP_WORLD_SIZE": "nodes in the job (= PARALLAX_NUM_NODES)",
    "ROLE_RANK": "the rank within the role (one role: = RANK)",
    "ROLE_WORLD_SIZE": "processes in the role (one role: = WORLD_SIZE)",
    "ROLE_NAME": "'default', torchrun's role name",
    "MASTER_ADDR": "the coordinator's host (node 0)",
    "MASTER_PORT": "the coordinator's port - 1, free for torch.distributed's store (rank 0 "
                   "hosts it: TORCHELASTIC_USE_AGENT_STORE=False); torchrun's variables read "
                   "by px.distributed put the JAX coordinator at MASTER_PORT + 1",
    "TORCHELASTIC_RESTART_COUNT": "restarts so far (= PARALLAX_RESTART)",
    "TORCHELASTIC_MAX_RESTARTS": "--max-restarts",
    "TORCHELASTIC_RUN_ID": "one id per launch (the coordinator's address)",
    "TORCHELASTIC_USE_AGENT_STORE": "'False': no agent hosts a store",
}


def torchrun_environment(coordinator: str, rank: int, node_ranks: Sequence[int],
                         world_size: int, node_rank: int, nnodes: int, restart: int,
                         max_restarts: int) -> dict[str, str]:
    """torchrun's variables for one process of ``parallax launch`` (:data:`TORCHRUN_EXPORTS`).

    Args:
      coordinator: ``host:port`` of the JAX coordinator (node 0).
      rank: the process's global rank.
      node_ranks: the global ranks started on its node, in order.
      world_size: processes in the job.
      node_rank, nnodes: its node's index and the number of nodes.
      restart, max_restarts: restarts so far and ``--max-restarts``.

    Returns:
      The variables, as strings.

    Example:
      >>> env = torchrun_environment("10.0.0.1:1234", 3, (2, 3), 4, 1, 2, 0, 0)
      >>> env["RANK"], env["LOCAL_RANK"], env["GROUP_RANK"], env["MASTER_PORT"]
      ('3', '1', '1', '1233')

    References:
      PyTorch torch/distributed/elastic/agent/server/local_elastic_agent.py
      (``LocalElasticAgent._start_workers``); torch/distributed/run.py.
    """
    host, port = coordinator.rpartition(":")[::2]
    return {
        "RANK": str(rank), "LOCAL_RANK": str(rank - node_ranks[0]),
        "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(len(node_ranks)),
        "GROUP_RANK": str(node_rank), "GROUP_WORLD_SIZE": str(nnodes),
        "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world_size),
        "ROLE_NAME": "default", "MASTER_ADDR": host, "MASTER_PORT": str(int(port) - 1),
        "TORCHELASTIC_RESTART_COUNT": str(restart),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        "TORCHELASTIC_RUN_ID": f"parallax-{coordinator}",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
    }
