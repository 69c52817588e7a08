"""TensorFlow's distribution API (``tf.distribute``), re-created on parallax's SPMD machinery.

Two families live here, each in its folder, over what they share at this level (the
distributed values, reduce ops, replica contexts, cross-replica reads and losses):

- ``mirrored/``: ``MirroredStrategy``, ``MultiWorkerMirroredStrategy``, ``OneDeviceStrategy``,
  the cross-device ops, ``strategy.extended``, the one program behind ``strategy.run``;
- ``parameter_server/``: ``ParameterServerStrategy`` with its variables, partitioners,
  cluster resolvers and ``ClusterCoordinator`` (on Ray);
- ``input/``: distributed datasets, input options, auto-sharding and TF's partial batches,
  which both families read.

See ``docs/tf.md``.
"""

# Shared by every strategy.
from parallax.tf.losses import compute_average_loss as compute_average_loss
from parallax.tf.losses import scale_regularization_loss as scale_regularization_loss
from parallax.tf.reduce_op import ReduceOp as ReduceOp
from parallax.tf.replica_context import ReplicaContext as ReplicaContext
from parallax.tf.replica_context import get_replica_context as get_replica_context
from parallax.tf.replica_context import in_cross_replica_context as in_cross_replica_context
from parallax.tf.values import Mirrored as Mirrored
from parallax.tf.values import PerReplica as PerReplica
from parallax.tf.values import VariableAggregation as VariableAggregation

# Input.
from parallax.tf.input.auto_shard import SHARD_HINT as SHARD_HINT
from parallax.tf.input.auto_shard import AutoShardPolicy as AutoShardPolicy
from parallax.tf.input.dataset import Dataset as Dataset
from parallax.tf.input.dataset import DatasetOptions as DatasetOptions
from parallax.tf.input.distributed import InputContext as InputContext
from parallax.tf.input.distributed import ValueContext as ValueContext
from parallax.tf.input.options import InputOptions as InputOptions
from parallax.tf.input.options import InputReplicationMode as InputReplicationMode

# The mirrored strategies.
from parallax.tf.mirrored.cross_device_ops import CollectiveAllReduce as CollectiveAllReduce
from parallax.tf.mirrored.cross_device_ops import CrossDeviceOps as CrossDeviceOps
from parallax.tf.mirrored.cross_device_ops import (
    HierarchicalCopyAllReduce as HierarchicalCopyAllReduce,
)
from parallax.tf.mirrored.cross_device_ops import NcclAllReduce as NcclAllReduce
from parallax.tf.mirrored.cross_device_ops import ReductionToOneDevice as ReductionToOneDevice
from parallax.tf.mirrored.extended import StrategyExtended as StrategyExtended
from parallax.tf.mirrored.multi_worker import CommunicationOptions as CommunicationOptions
from parallax.tf.mirrored.multi_worker import (
    MultiWorkerMirroredStrategy as MultiWorkerMirroredStrategy,
)
from parallax.tf.mirrored.one_device import OneDeviceStrategy as OneDeviceStrategy
from parallax.tf.mirrored.strategy import MirroredStrategy as MirroredStrategy
from parallax.tf.mirrored.strategy import get_strategy as get_strategy

# The parameter-server strategy and its coordinator. They run on Ray, an optional
# extra (parallax[ps]): the partitioners load here, the Ray-backed names on first use, so that
# `import parallax.tf` (and the mirrored strategies) never imports ray.
from parallax.ray_cluster.lazy_names import loader as _loader
from parallax.tf.parameter_server.cluster_resolver import (
    RayClusterResolver as RayClusterResolver,
)
from parallax.tf.parameter_server.partitioners import (
    FixedShardsPartitioner as FixedShardsPartitioner,
)
from parallax.tf.parameter_server.partitioners import MaxSizePartitioner as MaxSizePartitioner
from parallax.tf.parameter_server.partitioners import MinSizePartitioner as MinSizePartitioner
from parallax.tf.parameter_server.partitioners import Partitioner as Partitioner
from parallax.tf.parameter_server.tf_config_resolver import Server as Server
from parallax.tf.parameter_server.tf_config_resolver import (
    TFConfigClusterResolver as TFConfigClusterResolver,
)
from parallax.tf.parameter_server.variable import Variable as Variable

_PARAMETER_SERVER_NAMES = {
    "ClusterCoordinator": "parallax.tf.parameter_server.coordinator",
    "FunctionCancelledError": "parallax.tf.parameter_server.remote_value",
    "MissingOptimizerError": "parallax.tf.parameter_server.missing_optimizer",
    "ParameterServerStrategy": "parallax.tf.parameter_server.strategy",
    "PerWorkerIterator": "parallax.tf.parameter_server.remote_value",
    "PerWorkerValues": "parallax.tf.parameter_server.remote_value",
    "RemoteValue": "parallax.tf.parameter_server.remote_value",
    "ServerModel": "parallax.tf.parameter_server.server_model",
    "ServerOptimizer": "parallax.tf.parameter_server.server_optimizer",
    "ShardedVariable": "parallax.tf.parameter_server.sharded_variable",
    "SparseRows": "parallax.tf.parameter_server.sharded_variable",
    "embedding_lookup": "parallax.tf.parameter_server.embedding",
}

__getattr__ = _loader("parallax.tf", _PARAMETER_SERVER_NAMES)
