"""``MultiWorkerMirroredStrategy``: the mirrored strategy over several processes (workers).

TensorFlow's ``MultiWorkerMirroredStrategy`` reads the cluster from ``TF_CONFIG``, keeps a
copy of every variable on every device of every worker, and all-reduces gradients with
collective ops across workers. Here each worker is a process of a ``jax.distributed`` job,
joined by :func:`parallax.distributed.initialize` (which reads ``parallax launch``'s
environment, torchrun's, or ``TF_CONFIG``: the chief and the workers are the processes), and
the strategy is :class:`~parallax.tf.MirroredStrategy` over *all* the job's devices
on a ``(worker, replica)`` mesh: the same ``run`` / ``reduce`` / datasets API, the same one
compiled program per step, now spanning processes (XLA's collectives: NCCL across hosts on
GPU, gloo on CPU). Every process runs the same program:

    strategy = px.tf.MultiWorkerMirroredStrategy()     # first: joins the job
    with strategy.scope(): ...                         # as with MirroredStrategy

Input: ``experimental_distribute_dataset`` expects every worker to iterate the same global
batches and sends only its own replicas' rows (a plain iterable), or auto-shards a
:class:`~parallax.tf.Dataset` by its ``AutoShardPolicy`` (:mod:`parallax.tf.input.auto_shard`);
``distribute_datasets_from_function`` gives each worker an ``InputContext`` with its
``input_pipeline_id`` to shard its files by. ``experimental_local_results`` returns this
worker's replicas; ``reduce`` and ``gather`` return values every worker can read.

References:
  TensorFlow ``tf.distribute.MultiWorkerMirroredStrategy`` and
  ``tf.distribute.experimental.CommunicationOptions``; the multi-worker training tutorial.
"""

from __future__ import annotations

import dataclasses

import jax

from parallax import distributed
from parallax.tf.mirrored.cross_device_ops import (
    REPLICA_AXIS, CollectiveAllReduce, CrossDeviceOps, NcclAllReduce)
from parallax.tf.input.distributed import InputContext
from parallax.tf.mirrored.strategy import MirroredStrategy

WORKER_AXIS = "worker"
IMPLEMENTATIONS = ("AUTO", "RING", "NCCL")


@dataclasses.dataclass(frozen=True)
class CommunicationOptions:
    """How a multi-worker strategy all-reduces (TF's ``CommunicationOptions``).

    Attributes:
      bytes_per_pack: pack gradients into buffers of this many bytes (``0``: per leaf).
      implementation: ``"AUTO"`` or ``"NCCL"``: XLA's all-reduce (NCCL on GPU, gloo on CPU);
        ``"RING"``: the ring of point-to-point steps (:class:`NcclAllReduce`).

    Example:
      >>> CommunicationOptions(implementation="ring").cross_device_ops()
      NcclAllReduce(num_packs=1)

    References:
      TensorFlow, ``tf.distribute.experimental.CommunicationOptions``.
    """

    bytes_per_pack: int = 0
    implementation: str = "AUTO"

    def cross_device_ops(self) -> CrossDeviceOps:
        """The cross-device op these options select."""
        kind = str(self.implementation).upper()
        if kind not in IMPLEMENTATIONS:
            raise ValueError(
                f"px.tf.CommunicationOptions: implementation={self.implementation!r} must be "
                f"one of {IMPLEMENTATIONS}.")
        if kind == "RING":
            return NcclAllReduce()
        return CollectiveAllReduce(bytes_per_pack=self.bytes_per_pack)


class MultiWorkerMirroredStrategy(MirroredStrategy):
    """Synchronous training on every device of every worker process.

    Args:
      cluster_resolver: the cluster to join: ``None`` (read ``parallax launch``'s, torchrun's
        or ``TF_CONFIG``'s environment) or a :class:`parallax.distributed.ClusterSpec`.
      communication_options: a :class:`CommunicationOptions`, or directly a cross-device op
        (``px.tf.HierarchicalCopyAllReduce()`` reduces inside each worker, then across);
        default: XLA's all-reduce.

    Create it at the top of the program, before anything uses a device (joining a
    ``jax.distributed`` job must come first). The replicas form a ``(worker, replica)``
    mesh: worker ``w``'s ``k``-th local device is replica ``w * local_devices + k``.

    Example:
      >>> strategy = MultiWorkerMirroredStrategy()     # one process: all its devices
      >>> strategy.replica_axes, strategy.num_replicas_in_sync
      (('worker', 'replica'), 8)

    References:
      TensorFlow, ``tf.distribute.MultiWorkerMirroredStrategy``.
    """

    API = "px.tf.MultiWorkerMirroredStrategy"
    MULTI_WORKER = True

    def __init__(self, cluster_resolver: distributed.ClusterSpec | None = None,
                 communication_options: CommunicationOptions | CrossDeviceOps | None = None):
        api = self.API
        if cluster_resolver is None:
            spec = distributed.initialize()
        elif isinstance(cluster_resolver, distributed.ClusterSpec):
            spec = distributed.initialize(
                cluster_resolver.coordinator, cluster_resolver.num_processes,
                cluster_resolver.process_id, local_devices=cluster_resolver.local_devices)
        else:
            raise TypeError(f"{api}: cluster_resolver must be None (read the environment: "
                            "parallax launch, torchrun, TF_CONFIG) or a "
                            f"px.distributed.ClusterSpec; got {type(cluster_resolver).__name__}.")
        self._cluster = spec
        if communication_options is None:
            communication_options = CommunicationOptions()
        if isinstance(communication_options, CommunicationOptions):
            ops = communication_options.cross_device_ops()
        elif isinstance(communication_options, CrossDeviceOps):
            ops = communication_options
        else:
            raise TypeError(f"{api}: communication_options must be a px.tf.CommunicationOptions "
                            "or a cross-device op; got "
                            f"{type(communication_options).__name__}.")
        super().__init__(devices=None, cross_device_ops=ops)

    def _devices_for(self, devices) -> tuple:
        del devices  # every device of every worker, worker-major
        return tuple(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))

    def _mesh_axes(self) -> tuple[tuple[str, int], ...]:
        workers = jax.process_count()
        return ((WORKER_AXIS, workers), (REPLICA_AXIS, len(self._devices) // workers))

    @property
    def cluster_resolver(self) -> distributed.ClusterSpec:
        """The cluster this process joined."""
        return self._cluster

    def input_context(self) -> InputContext:
        """One input pipeline per worker; this worker's is ``jax.process_index()``."""
        return InputContext(jax.process_count(), jax.process_index(), self.num_replicas_in_sync)
