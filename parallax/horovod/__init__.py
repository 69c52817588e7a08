"""parallax.horovod: Horovod's API on JAX's runtime (``import parallax.horovod as hvd``).

A Horovod script keeps its shape:

    import parallax.horovod as hvd
    hvd.init()                                                  # px.distributed.initialize()
    tx = hvd.DistributedOptimizer(optax.adam(1e-3 * hvd.size()))
    params = hvd.broadcast_parameters(params, root_rank=0)
    opt_state = tx.init(params)

    @hvd.jit                                                    # one program over every rank
    def step(params, opt_state, batch):                         # batch: this rank's rows
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, hvd.allreduce(loss)

and runs with ``parallax launch -np 4 python train.py`` (Horovod's ``horovodrun -np 4``).
A rank is a device, as in Horovod (one rank per accelerator): ``size()`` counts every device
of every process, which is what ``@hvd.jit``'s reductions run over; a process holding K
devices holds K ranks and answers ``rank()`` for its first (:mod:`parallax.horovod.ranks`).
Collectives are XLA's, started by ``jax.distributed``: no transport of our own.
Elastic training: ``hvd.elastic.State`` / ``hvd.elastic.run`` (docs/checkpoint.md). Process
sets, grouped collectives, ``reducescatter``, ``join``, the timeline and the rest of
Horovod's API, with what differs and why: docs/horovod.md.

Example:
  >>> import jax, parallax.horovod as hvd
  >>> hvd.init()
  >>> hvd.rank(), hvd.size() == jax.device_count(), hvd.local_rank()
  (0, True, 0)
"""

from parallax.horovod import elastic as elastic
from parallax.horovod.elastic_state import HorovodInternalError as HorovodInternalError
from parallax.horovod.elastic_state import HostsUpdatedInterrupt as HostsUpdatedInterrupt
from parallax.horovod.broadcast import allgather_object as allgather_object
from parallax.horovod.broadcast import broadcast_object as broadcast_object
from parallax.horovod.broadcast import broadcast_optimizer_state as broadcast_optimizer_state
from parallax.horovod.broadcast import broadcast_parameters as broadcast_parameters
from parallax.horovod.collectives import AXIS as AXIS
from parallax.horovod.collectives import allgather as allgather
from parallax.horovod.collectives import allreduce as allreduce
from parallax.horovod.alltoall import alltoall as alltoall
from parallax.horovod.collectives import broadcast as broadcast
from parallax.horovod.grouped import grouped_allgather as grouped_allgather
from parallax.horovod.grouped import grouped_allreduce as grouped_allreduce
from parallax.horovod.grouped import grouped_reducescatter as grouped_reducescatter
from parallax.horovod.grouped import reducescatter as reducescatter
from parallax.horovod.join import join as join
from parallax.horovod.ops import Adasum as Adasum
from parallax.horovod.ops import Average as Average
from parallax.horovod.ops import Compression as Compression
from parallax.horovod.ops import Max as Max
from parallax.horovod.ops import Min as Min
from parallax.horovod.ops import Product as Product
from parallax.horovod.ops import ReduceOp as ReduceOp
from parallax.horovod.ops import Sum as Sum
from parallax.horovod.optimizer import DistributedOptimizer as DistributedOptimizer
from parallax.horovod.optimizer import DistributedOptimizerState as DistributedOptimizerState
from parallax.horovod.per_rank import PerRank as PerRank
from parallax.horovod.process_sets import ProcessSet as ProcessSet
from parallax.horovod.process_sets import add_process_set as add_process_set
from parallax.horovod.process_sets import global_process_set as global_process_set
from parallax.horovod.process_sets import remove_process_set as remove_process_set
from parallax.horovod.program import jit as jit
from parallax.horovod.program import mesh as mesh
from parallax.horovod.ranks import cross_rank as cross_rank
from parallax.horovod.ranks import cross_size as cross_size
from parallax.horovod.ranks import is_homogeneous as is_homogeneous
from parallax.horovod.ranks import local_rank as local_rank
from parallax.horovod.ranks import local_size as local_size
from parallax.horovod.ranks import rank as rank
from parallax.horovod.ranks import size as size
from parallax.horovod.runtime import init as init
from parallax.horovod.runtime import gloo_enabled as gloo_enabled
from parallax.horovod.runtime import is_initialized as is_initialized
from parallax.horovod.runtime import mpi_built as mpi_built
from parallax.horovod.runtime import mpi_enabled as mpi_enabled
from parallax.horovod.runtime import mpi_threads_supported as mpi_threads_supported
from parallax.horovod.runtime import nccl_built as nccl_built
from parallax.horovod.runtime import shutdown as shutdown
from parallax.horovod.timeline import start_timeline as start_timeline
from parallax.horovod.timeline import stop_timeline as stop_timeline

__all__ = [
    "AXIS",
    "Adasum",
    "Average",
    "Compression",
    "DistributedOptimizer",
    "DistributedOptimizerState",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "Max",
    "Min",
    "PerRank",
    "ProcessSet",
    "Product",
    "ReduceOp",
    "Sum",
    "add_process_set",
    "allgather",
    "allgather_object",
    "allreduce",
    "alltoall",
    "broadcast",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "cross_rank",
    "cross_size",
    "elastic",
    "global_process_set",
    "gloo_enabled",
    "grouped_allgather",
    "grouped_allreduce",
    "grouped_reducescatter",
    "init",
    "is_homogeneous",
    "is_initialized",
    "jit",
    "join",
    "local_rank",
    "local_size",
    "mesh",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "rank",
    "reducescatter",
    "remove_process_set",
    "shutdown",
    "size",
    "start_timeline",
    "stop_timeline",
]
