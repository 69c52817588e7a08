"""Cross-device ops: the all-reduce algorithms a mirrored strategy sums gradients with.

TensorFlow's ``MirroredStrategy(cross_device_ops=...)`` picks how per-replica values are
reduced. Here each op is a small immutable value whose ``all_reduce`` runs inside the
strategy's ``shard_map`` over the replica axes and is built from :mod:`parallax.comm`:

=============================  ===============================================  ==========================================
op                             algorithm                                        collectives in the compiled program
=============================  ===============================================  ==========================================
``CollectiveAllReduce()``      XLA's all-reduce (NCCL on GPU, ICI on TPU)       one ``all-reduce`` per leaf (or pack)
``NcclAllReduce()``            NCCL's ring: reduce-scatter + all-gather rings   ``2 (n - 1)`` ``collective-permute`` per pack
``HierarchicalCopyAllReduce``  reduce-scatter in a group, all-reduce across,     ``reduce-scatter``, ``all-reduce``,
                               all-gather in the group (two mesh axes)          ``all-gather`` per pack
``ReductionToOneDevice()``     every replica sends to one device, which adds    ``n - 1`` + ``n - 1``
                               and broadcasts back                              ``collective-permute``, one ``all-gather``
=============================  ===============================================  ==========================================

``num_packs`` (TF's name) packs the leaves of one dtype into that many flat buffers before
reducing (``0``: one reduction per leaf), as TF's ``NcclAllReduce(num_packs=1)`` does.
All give the plain all-reduce's values up to the order of additions.

References:
  TensorFlow ``tf.distribute.CrossDeviceOps``, ``NcclAllReduce``,
  ``HierarchicalCopyAllReduce``, ``ReductionToOneDevice``,
  ``experimental.CommunicationOptions``; Patarasuk & Yuan 2009 (ring); Goyal et al. 2017
  and Jia et al. 2018 (hierarchical).
"""

from __future__ import annotations

import abc
import dataclasses
import math

import jax
import numpy as np

from parallax import comm
from parallax.strategies.reduce_to_one import reduce_to_one_all_reduce
from parallax.tf.reduce_op import ReduceOp

REPLICA_AXIS = "replica"
GROUP_AXIS = "group"


def _check_count(api: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{api}: {name}={value!r} must be an int >= 0.")
    return value


def _pack_bytes(values, num_packs: int) -> int | None:
    """The bucket size that cuts the largest dtype group into ``num_packs`` packs."""
    if num_packs == 0:
        return 0
    if num_packs == 1:
        return None
    totals: dict = {}
    for v in values:
        totals[np.dtype(v.dtype)] = totals.get(np.dtype(v.dtype), 0) + v.size * v.dtype.itemsize
    return max(1, math.ceil(max(totals.values(), default=1) / num_packs))


def _op_name(op: ReduceOp) -> str:
    return "mean" if op is ReduceOp.MEAN else "sum"


@dataclasses.dataclass(frozen=True)
class CrossDeviceOps(abc.ABC):
    """Base of the cross-device ops: how ``all_reduce`` sums per-replica values.

    Subclasses implement ``all_reduce(values, axes, op, mesh) -> list`` (called inside the
    strategy's ``shard_map``, on each replica's local arrays) and may ask for a mesh layout
    of the replicas through ``mesh_axes``.

    References:
      TensorFlow, ``tf.distribute.CrossDeviceOps``.
    """

    def mesh_axes(self, num_replicas: int) -> tuple[tuple[str, int], ...]:
        """The replica mesh this op wants: ``((name, size), ...)``; one axis by default."""
        return ((REPLICA_AXIS, num_replicas),)

    @abc.abstractmethod
    def all_reduce(self, values: list, axes: tuple[str, ...], op: ReduceOp, mesh) -> list:
        """Reduces each of ``values`` over ``axes``; every replica gets the results."""


@dataclasses.dataclass(frozen=True)
class CollectiveAllReduce(CrossDeviceOps):
    """XLA's own all-reduce (``lax.psum``): the default, what ``px.DataParallel`` does.

    On GPU XLA runs it with NCCL, on TPU over ICI; it is TF's collective all-reduce
    (``CommunicationImplementation.AUTO``).

    Attributes:
      bytes_per_pack: pack the leaves into buffers of this many bytes first (TF's
        ``CommunicationOptions.bytes_per_pack``); ``0``: one all-reduce per leaf.

    Example:
      >>> import jax.numpy as jnp, parallax as px
      >>> strategy = px.tf.MirroredStrategy(cross_device_ops=CollectiveAllReduce())
      >>> out = strategy.run(lambda: px.tf.get_replica_context().all_reduce("SUM", 1.0))
      >>> float(out.values[0])
      8.0

    References:
      TensorFlow ``CollectiveAllReduce`` and ``CommunicationOptions``.
    """

    bytes_per_pack: int = 0

    def __post_init__(self):
        _check_count("px.tf.CollectiveAllReduce", "bytes_per_pack", self.bytes_per_pack)

    def all_reduce(self, values, axes, op, mesh):
        del mesh
        axis = axes if len(axes) > 1 else axes[0]
        if self.bytes_per_pack == 0:
            return comm.all_reduce(list(values), axis, _op_name(op))
        return comm.bucketed_all_reduce(list(values), axis, bucket_bytes=self.bytes_per_pack,
                                        reverse=False, op=_op_name(op))


@dataclasses.dataclass(frozen=True)
class NcclAllReduce(CrossDeviceOps):
    """NCCL's ring all-reduce, written as point-to-point steps (:func:`parallax.comm.ring_all_reduce`).

    Each pack is a ring reduce-scatter then a ring all-gather: ``2 (n - 1)`` messages of
    ``S / n`` per device, the bandwidth lower bound.

    Attributes:
      num_packs: flat buffers per dtype (TF's default 1); ``0``: one ring per leaf.

    Example:
      >>> import jax.numpy as jnp, parallax as px
      >>> strategy = px.tf.MirroredStrategy(cross_device_ops=NcclAllReduce())
      >>> out = strategy.run(lambda: px.tf.get_replica_context().all_reduce("MEAN", 2.0))
      >>> float(out.values[5])
      2.0

    References:
      TensorFlow ``tf.distribute.NcclAllReduce``; Patarasuk & Yuan 2009.
    """

    num_packs: int = 1

    def __post_init__(self):
        _check_count("px.tf.NcclAllReduce", "num_packs", self.num_packs)

    def all_reduce(self, values, axes, op, mesh):
        del mesh
        axis = axes if len(axes) > 1 else axes[0]
        return comm.bucketed_all_reduce(
            list(values), axis, bucket_bytes=_pack_bytes(values, self.num_packs),
            reverse=False, op=_op_name(op), algorithm="ring")


@dataclasses.dataclass(frozen=True)
class HierarchicalCopyAllReduce(CrossDeviceOps):
    """Hierarchical all-reduce over two mesh axes: inside groups, then across them.

    The replicas form a ``(group, replica)`` mesh of ``n / group_size`` groups (one per
    worker under multi-worker strategies). Each pack is reduce-scattered inside a group,
    all-reduced across groups (only ``S / group_size`` crosses the slow links), and
    all-gathered inside the group (:func:`parallax.comm.hierarchical_all_reduce`).
    TensorFlow's version copies to one GPU per group of a DGX-1 and back along the same
    tree; this one moves the same sum with XLA's collectives.

    Attributes:
      num_packs: flat buffers per dtype (TF's default 1); ``0``: one per leaf.
      group_size: replicas per group; default: half of them (two groups, a DGX-1's two
        quads of four GPUs on eight), or all of them (one group) for 1, 2 or an odd count.

    Example:
      >>> import jax.numpy as jnp, parallax as px
      >>> strategy = px.tf.MirroredStrategy(cross_device_ops=HierarchicalCopyAllReduce())
      >>> strategy.replica_axes, strategy.mesh.axis_sizes
      (('group', 'replica'), (2, 4))

    References:
      TensorFlow ``tf.distribute.HierarchicalCopyAllReduce``; Horovod's hierarchical
      all-reduce (Sergeev & Del Balso 2018).
    """

    num_packs: int = 1
    group_size: int | None = None

    def __post_init__(self):
        api = "px.tf.HierarchicalCopyAllReduce"
        _check_count(api, "num_packs", self.num_packs)
        if self.group_size is not None and (
                isinstance(self.group_size, bool) or not isinstance(self.group_size, int)
                or self.group_size < 1):
            raise ValueError(f"{api}: group_size={self.group_size!r} must be an int >= 1.")

    def mesh_axes(self, num_replicas):
        size = self.group_size
        if size is None:
            size = num_replicas // 2 if num_replicas % 2 == 0 and num_replicas > 2 else (
                num_replicas)
        if num_replicas % size:
            raise ValueError(
                f"px.tf.HierarchicalCopyAllReduce: group_size={size} does not divide the "
                f"{num_replicas} replicas; pick a divisor of {num_replicas}.")
        return ((GROUP_AXIS, num_replicas // size), (REPLICA_AXIS, size))

    def all_reduce(self, values, axes, op, mesh):
        del mesh
        if len(axes) != 2:
            raise ValueError(
                f"px.tf.HierarchicalCopyAllReduce: needs two replica axes (outer, inner); the "
                f"strategy has {axes}.")
        return comm.bucketed_all_reduce(
            list(values), tuple(axes), bucket_bytes=_pack_bytes(values, self.num_packs),
            reverse=False, op=_op_name(op), algorithm="hierarchical")


@dataclasses.dataclass(frozen=True)
class ReductionToOneDevice(CrossDeviceOps):
    """Reduce on one device, broadcast back: TF's fallback op, PyTorch DataParallel's pattern.

    Every other replica sends its value to ``reduce_to_device``, which adds them; the sum is
    scattered from it and all-gathered (see
    :func:`parallax.strategies.reduce_to_one.reduce_to_one_all_reduce`). One reduction per
    leaf, as in TensorFlow.

    Attributes:
      reduce_to_device: the device that reduces: a ``jax.Device`` of the strategy, or a
        replica index; ``None``: the first replica.

    Example:
      >>> import jax.numpy as jnp, parallax as px
      >>> strategy = px.tf.MirroredStrategy(cross_device_ops=ReductionToOneDevice(3))
      >>> out = strategy.run(lambda: px.tf.get_replica_context().all_reduce("SUM", 1.0))
      >>> float(out.values[7])
      8.0

    References:
      TensorFlow ``tf.distribute.ReductionToOneDevice``; PyTorch ``nn.DataParallel``.
    """

    reduce_to_device: int | jax.Device | None = None

    def __post_init__(self):
        root = self.reduce_to_device
        if root is not None and not isinstance(root, jax.Device) and (
                isinstance(root, bool) or not isinstance(root, int) or root < 0):
            raise TypeError(
                "px.tf.ReductionToOneDevice: reduce_to_device must be a jax.Device of the "
                f"strategy, a replica index >= 0 or None; got {root!r}.")

    def root_index(self, mesh) -> int:
        """The replica (flat index into ``mesh.devices``) that reduces."""
        root = self.reduce_to_device
        flat = list(mesh.devices.flat)
        if root is None:
            return 0
        if isinstance(root, jax.Device):
            if root not in flat:
                raise ValueError(
                    f"px.tf.ReductionToOneDevice: reduce_to_device={root} is not one of the "
                    f"strategy's devices {[str(d) for d in flat]}.")
            return flat.index(root)
        if root >= len(flat):
            raise ValueError(
                f"px.tf.ReductionToOneDevice: reduce_to_device={root} is not a replica index "
                f"of the {len(flat)} replicas; pick one in [0, {len(flat)}).")
        return root

    def all_reduce(self, values, axes, op, mesh):
        axis = axes if len(axes) > 1 else axes[0]
        return reduce_to_one_all_reduce(list(values), axis, self.root_index(mesh),
                                        op=_op_name(op), bucket_bytes=0)
