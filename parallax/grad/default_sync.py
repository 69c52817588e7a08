"""The gradient sum a data-parallel step runs when its strategy names none: the backend's.

``px.DataParallel("data")`` (no ``sync=``) sums each gradient over the batch axes with one
all-reduce, and which all-reduce is decided when the step is traced, from the mesh:

==========================================  ==============================================
the batch axes' devices                     the sum
==========================================  ==============================================
CPU devices in more than one process        ``parallax.comm``'s tree exchange (recursive
(gloo)                                      doubling: for two processes one
                                            ``collective-permute`` of each gradient)
one process (simulated CPU devices), or     XLA's all-reduce (``psum``): NCCL on GPU, ICI
GPU / TPU devices, or an abstract mesh      on TPU, in-process on CPU
==========================================  ==============================================

Why: on CPU, XLA's all-reduce combiner (the ``cpu-all-reduce-combiner`` pass) merges the
per-gradient ``psum`` s into one all-reduce of every gradient, which can start only when the
backward has produced the last of them, so none of the sum overlaps the backward. The
exchanges of the tree are ``collective-permute`` s, which no pass combines: each gradient
leaves as soon as the backward produces it. Measured (``docs/performance.md, "The gradient sync across processes"``): 2 CPU
processes, MLP 4 x 1024, Adam: XLA's all-reduce 1.01-1.29x torch DDP's step time, the
same program with the combiner off 0.74-1.00x, the tree 0.74-0.81x. On GPU and TPU XLA's
own collectives (NCCL, ICI) are the fast ones (not measured here). One process of simulated
CPU devices keeps XLA's all-reduce so that its programs stay as they were, although the tree
measured faster there too (``docs/performance.md, "The gradient sync across processes"``): a change of its own, not made yet.

:class:`AllReduceSync` is that sum as a value, and the override:
``px.DataParallel("data", sync="xla")`` keeps XLA's all-reduce everywhere,
``sync="tree"`` (or ``"ring"``) uses the exchange everywhere.

Example:
  >>> import parallax as px
  >>> mesh = px.make_mesh(data=2, devices=jax.devices()[:2])
  >>> default_sync(mesh, ("data",))   # one process: XLA's all-reduce
  AllReduceSync(algorithm='xla')
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax import lax

from parallax.comm.wrappers import all_reduce

# XLA's all-reduce, or parallax.comm's point-to-point algorithms ("auto": ring or tree per
# gradient by parallax.comm.cost).
ALGORITHMS = ("xla", "tree", "ring", "auto")


@dataclasses.dataclass(frozen=True)
class AllReduceSync:
    """Sums each gradient on its own over the batch axes: one all-reduce per gradient.

    Attributes:
      algorithm: ``"xla"`` (``lax.psum``: XLA's all-reduce, which its combiner may merge
        into one instruction), or a point-to-point algorithm of :mod:`parallax.comm` built
        from ``collective-permute`` s: ``"tree"`` (recursive doubling), ``"ring"``, or
        ``"auto"`` (ring or tree per gradient by :func:`parallax.comm.cost.choose_algorithm`).
        The point-to-point sums are bit-identical on every device but typed varying
        (:attr:`varying_results`): they are taken in an unchecked ``shard_map`` of their
        own, after the step's checked one (:mod:`parallax.grad.explicit`).

    A value (equal settings compare equal), so strategies holding it compose and compare.

    Example:
      >>> AllReduceSync("tree").varying_results
      True

    References:
      Thakur, Rabenseifner & Gropp, "Optimization of collective communication operations
      in MPICH", IJHPCA 2005 (recursive doubling, ring).
    """

    algorithm: str = "xla"

    def __post_init__(self):
        if self.algorithm not in ALGORITHMS:
            raise ValueError(
                f"px.AllReduceSync: algorithm={self.algorithm!r} must be one of "
                f"{', '.join(map(repr, ALGORITHMS))}: 'xla' for XLA's all-reduce, or a "
                "point-to-point algorithm of parallax.comm.")

    @property
    def varying_results(self) -> bool:
        """Whether the sums come back typed varying over the batch axes."""
        return self.algorithm != "xla"

    def __call__(self, grads: list[jax.Array], axes: tuple[str, ...]) -> list[jax.Array]:
        axis = axes if len(axes) > 1 else axes[0]
        if self.algorithm == "xla":
            return [lax.psum(g, axis) for g in grads]
        return list(all_reduce(list(grads), axis, algorithm=self.algorithm))


def mesh_devices(mesh) -> np.ndarray | None:
    """The mesh's devices, or None for a mesh without them (``jax.sharding.AbstractMesh``)."""
    try:
        devices = mesh.devices
    except (AttributeError, ValueError):  # AbstractMesh: "does not implement devices"
        return None
    return devices if isinstance(devices, np.ndarray) else None


def spans_processes(mesh, axes) -> bool:
    """Whether the devices along ``axes`` (any one group that a sum over them reduces)
    belong to more than one process. False for a mesh without devices (an abstract one)."""
    devices = mesh_devices(mesh)
    if devices is None or not axes:
        return False
    owners = np.vectorize(lambda d: d.process_index, otypes=[int])(devices)
    names = list(mesh.axis_names)
    moved = np.moveaxis(owners, [names.index(a) for a in axes],
                        list(range(owners.ndim - len(axes), owners.ndim)))
    groups = moved.reshape(-1, math.prod(mesh.shape[a] for a in axes))
    return bool((groups != groups[:, :1]).any())


def default_sync(mesh, axes) -> AllReduceSync:
    """The sum the backend does fastest for a sum over ``axes`` (the table above)."""
    devices = mesh_devices(mesh)
    cpu = devices is not None and devices.flat[0].platform == "cpu"
    return AllReduceSync("tree" if cpu and spans_processes(mesh, axes) else "xla")


def chosen_sync(grad_sync, mesh, axes):
    """The sync a step over ``axes`` runs: the strategy's own, else :func:`default_sync`."""
    return grad_sync if grad_sync is not None else default_sync(mesh, axes)


def describe_sync(grad_sync, mesh, axes, style: str = "explicit") -> str:
    """One line for ``px.explain``: which sum the step runs over its batch axes, and why."""
    if not axes:
        return "none (no batch axis of more than one device)"
    if style == "gspmd":
        return "XLA's all-reduce, inserted by GSPMD (style='gspmd')"
    if grad_sync is not None:
        return f"{grad_sync!r} (the strategy's)"
    sync = default_sync(mesh, axes)
    if sync.algorithm == "tree":
        return (f"{sync!r}: the default for CPU devices in several processes (one exchange "
                "per gradient, overlapping the backward); sync='xla' for XLA's all-reduce")
    return f"{sync!r}: the default here (XLA's all-reduce); sync='tree' for exchanges"
