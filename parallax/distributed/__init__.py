"""parallax.distributed: many processes and hosts on JAX's own runtime (``jax.distributed``).

Every process of a job runs the same program:

    import parallax as px
    px.distributed.initialize()            # reads parallax launch / torchrun / TF_CONFIG / SLURM ...
    mesh = px.make_mesh(data=-1)           # all devices of all processes
    rows = px.distributed.process_slice(global_batch_size, mesh, strategy)
    batch = px.distributed.global_batch(load(rows), mesh, strategy)

and is started by ``parallax launch -np N python train.py`` (or torchrun, SLURM, a TF
cluster). Coordination is JAX's coordination service, collectives are XLA's (NCCL on GPU,
ICI/DCN on TPU, gloo on CPU): parallax adds the environment detection, the launcher, the
per-process batches and the failure handling around them.

Example:
  >>> import parallax as px
  >>> px.distributed.initialize().num_processes
  1
"""

from parallax.distributed.batches import global_batch as global_batch
from parallax.distributed.broadcasting import broadcast as broadcast
from parallax.distributed.batches import process_slice as process_slice
from parallax.distributed.environment import LAUNCH_VARIABLES as LAUNCH_VARIABLES
from parallax.distributed.environment import ClusterSpec as ClusterSpec
from parallax.distributed.environment import detect as detect
from parallax.distributed.runtime import barrier as barrier
from parallax.distributed.runtime import initialize as initialize
from parallax.distributed.runtime import is_chief as is_chief
from parallax.distributed.runtime import local_rank as local_rank
from parallax.distributed.runtime import local_size as local_size
from parallax.distributed.runtime import rank as rank
from parallax.distributed.runtime import shutdown as shutdown
from parallax.distributed.runtime import size as size

__all__ = [
    "ClusterSpec",
    "LAUNCH_VARIABLES",
    "barrier",
    "broadcast",
    "detect",
    "global_batch",
    "initialize",
    "is_chief",
    "local_rank",
    "local_size",
    "process_slice",
    "rank",
    "shutdown",
    "size",
]
