"""TensorFlow's distribution API (``tf.distribute``), re-created on parallax's SPMD machinery.

Two families live here: the mirrored strategies (``MirroredStrategy``,
``MultiWorkerMirroredStrategy``, the cross-device ops) and the parameter-server strategy with
its ``ClusterCoordinator`` (on Ray). See ``docs/tf.md``.
"""

# The mirrored strategies.
from parallax.tf.auto_shard import SHARD_HINT as SHARD_HINT
from parallax.tf.auto_shard import AutoShardPolicy as AutoShardPolicy
from parallax.tf.cross_device_ops import CollectiveAllReduce as CollectiveAllReduce
from parallax.tf.cross_device_ops import CrossDeviceOps as CrossDeviceOps
from parallax.tf.cross_device_ops import HierarchicalCopyAllReduce as HierarchicalCopyAllReduce
from parallax.tf.cross_device_ops import NcclAllReduce as NcclAllReduce
from parallax.tf.cross_device_ops import ReductionToOneDevice as ReductionToOneDevice
from parallax.tf.distributed_input import InputContext as InputContext
from parallax.tf.distributed_input import ValueContext as ValueContext
from parallax.tf.extended import StrategyExtended as StrategyExtended
from parallax.tf.input_options import InputOptions as InputOptions
from parallax.tf.input_options import InputReplicationMode as InputReplicationMode
from parallax.tf.losses import compute_average_loss as compute_average_loss
from parallax.tf.losses import scale_regularization_loss as scale_regularization_loss
from parallax.tf.mirrored import MirroredStrategy as MirroredStrategy
from parallax.tf.mirrored import get_strategy as get_strategy
from parallax.tf.multi_worker import CommunicationOptions as CommunicationOptions
from parallax.tf.multi_worker import MultiWorkerMirroredStrategy as MultiWorkerMirroredStrategy
from parallax.tf.one_device import OneDeviceStrategy as OneDeviceStrategy
from parallax.tf.reduce_op import ReduceOp as ReduceOp
from parallax.tf.replica_context import ReplicaContext as ReplicaContext
from parallax.tf.replica_context import get_replica_context as get_replica_context
from parallax.tf.replica_context import in_cross_replica_context as in_cross_replica_context
from parallax.tf.sharded_dataset import Dataset as Dataset
from parallax.tf.sharded_dataset import DatasetOptions as DatasetOptions
from parallax.tf.values import Mirrored as Mirrored
from parallax.tf.values import PerReplica as PerReplica
from parallax.tf.values import VariableAggregation as VariableAggregation

# The parameter-server strategy and its coordinator. They run on Ray, an optional
# extra (parallax[ps]): the partitioners load here, the Ray-backed names on first use, so that
# `import parallax.tf` (and the mirrored strategies) never imports ray.
from parallax.ray_cluster.lazy_names import loader as _loader  # noqa: E402
from parallax.tf.cluster_resolver import RayClusterResolver as RayClusterResolver  # noqa: E402
from parallax.tf.partitioners import FixedShardsPartitioner as FixedShardsPartitioner  # noqa: E402
from parallax.tf.partitioners import MaxSizePartitioner as MaxSizePartitioner  # noqa: E402
from parallax.tf.partitioners import MinSizePartitioner as MinSizePartitioner  # noqa: E402
from parallax.tf.partitioners import Partitioner as Partitioner  # noqa: E402
from parallax.tf.ps_variable import Variable as Variable  # noqa: E402
from parallax.tf.tf_config_resolver import Server as Server  # noqa: E402
from parallax.tf.tf_config_resolver import (  # noqa: E402
    TFConfigClusterResolver as TFConfigClusterResolver,
)

_PARAMETER_SERVER_NAMES = {
    "ClusterCoordinator": "parallax.tf.coordinator",
    "FunctionCancelledError": "parallax.tf.remote_value",
    "ParameterServerStrategy": "parallax.tf.parameter_server",
    "PerWorkerIterator": "parallax.tf.remote_value",
    "PerWorkerValues": "parallax.tf.remote_value",
    "RemoteValue": "parallax.tf.remote_value",
    "ServerModel": "parallax.tf.server_model",
    "ShardedVariable": "parallax.tf.sharded_variable",
    "SparseRows": "parallax.tf.sharded_variable",
    "embedding_lookup": "parallax.tf.embedding",
}

__getattr__ = _loader("parallax.tf", _PARAMETER_SERVER_NAMES)
