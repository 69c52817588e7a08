"""Gradient synchronisation hooks: how the explicit style sums gradients over batch axes.

A data-parallel strategy sums each device's gradients over its batch axes. By default that
is one all-reduce per leaf, the backend's fast one (:class:`AllReduceSync`, chosen by
:mod:`parallax.grad.default_sync`: parallax.comm's tree exchange across CPU processes,
XLA's ``psum`` elsewhere). A *sync* replaces it: a callable
``sync(grads, axes) -> grads`` that runs inside the step's ``shard_map`` on the local
gradients (a list of arrays) and returns their sums over the mesh ``axes``, invariant over
them (built from XLA collectives, e.g. ``parallax.comm`` with ``algorithm="xla"``); a sync
whose sums are equal on every device but typed varying (point-to-point messages) says so
with a true ``varying_results`` attribute, and then runs in a ``shard_map`` of its own,
unchecked (``check_vma=False``), after the step's checked one (see
:mod:`parallax.grad.explicit`). Under
ZeRO 2/3 it receives what is left after the reduce-scatter over the ZeRO axis (the
cross-replica all-reduce of HSDP); leaves that are tensor-parallel shards arrive as their
local shards.

:class:`BucketedSync` is PyTorch DDP's reducer and Horovod's tensor fusion: the gradients
packed into flat buckets in reverse order, one all-reduce per bucket.

Example:
  >>> import parallax as px
  >>> ddp = px.DataParallel("data", sync=px.BucketedSync(bucket_bytes=25 * 2**20))
  >>> ddp.grad_sync.bucket_bytes
  26214400
"""

from __future__ import annotations

import dataclasses

import jax

from parallax.comm import bucket
from parallax.grad.default_sync import AllReduceSync as AllReduceSync

# XLA's all-reduce, or parallax.comm's point-to-point algorithms ("hierarchical" needs two
# named axes, which a sync over the batch axes does not have).
SYNC_ALGORITHMS = ("xla", "tree", "ring", "auto")


@dataclasses.dataclass(frozen=True)
class BucketedSync:
    """Sums gradients as flat buckets, one all-reduce each (DDP's reducer, Horovod fusion).

    Attributes:
      bucket_bytes: bucket capacity (DDP's default 25 MiB; Horovod's fusion threshold is
        64 MiB). ``0`` gives one all-reduce per leaf; ``None`` one per dtype.
      reverse: fill buckets from the last parameter backwards (DDP: the backward pass
        produces the last layers' gradients first).
      compression: ``None``, ``"bf16"`` or ``"fp16"``: cast on the wire. With XLA's
        all-reduce the sum is taken in the wire dtype on GPU and TPU; the CPU compiler
        widens bf16 all-reduces to float32 (see ``docs/comm.md``).
      packing: ``"operands"`` (the default: each bucket is one ``psum`` over its gradients
        in their own shapes, one variadic all-reduce after XLA's combiner; no copy) or
        ``"flat"`` (DDP's bucket buffer: the gradients concatenated into one flat array per
        bucket, one all-reduce instruction each even with the combiner off). Measured on CPU
        (``docs/distributed.md``), the flat buffer's concatenate made a step slower than the
        plain sync; ``"operands"`` compiles to the plain sync's program.
      algorithm: ``"xla"`` (the default: XLA's all-reduce, NCCL on GPU, ICI on TPU, gloo on
        CPU) or a point-to-point algorithm of :mod:`parallax.comm` built from
        ``collective-permute`` s: ``"tree"`` (recursive doubling; for two devices one
        exchange of the whole gradient), ``"ring"`` or ``"auto"`` (ring or tree per
        gradient by :func:`parallax.comm.cost.choose_algorithm`). With ``"operands"``
        packing each gradient is reduced on its own as soon as the backward produces it.
        Across CPU processes this is the fast choice (and, per gradient without buckets,
        the default there: :class:`AllReduceSync`): XLA's CPU all-reduce combiner merges
        the gradients' all-reduces into one after the backward, and gloo's ring moves it
        in 1 MiB round trips (``docs/performance.md, "The gradient sync across processes"`` has the measurements).
        Every device adds the same numbers in the same order, so the sums are bit-identical
        across devices; they are typed varying (:attr:`varying_results`), and are taken
        in an unchecked ``shard_map`` of their own.

    A value (equal settings compare equal), so strategies holding it compose and compare.

    References:
      Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training",
      VLDB 2020 (gradient buckets). Sergeev & Del Balso, "Horovod", 2018 (tensor fusion).
    """

    bucket_bytes: int | None = bucket.DEFAULT_BUCKET_BYTES
    reverse: bool = True
    compression: str | None = None
    packing: str = "operands"
    algorithm: str = "xla"

    def __post_init__(self):
        size = self.bucket_bytes
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
            raise ValueError(
                f"px.BucketedSync: bucket_bytes={size!r} must be an int >= 0 (0: one all-reduce "
                "per leaf) or None (one bucket per dtype).")
        if self.compression not in (None, "bf16", "fp16"):
            raise ValueError(
                f"px.BucketedSync: compression={self.compression!r} must be None, 'bf16' or "
                "'fp16'.")
        if self.packing not in bucket.PACKINGS:
            raise ValueError(
                f"px.BucketedSync: packing={self.packing!r} must be 'operands' (one psum over "
                "each bucket's gradients) or 'flat' (a concatenated bucket buffer).")
        if self.algorithm not in SYNC_ALGORITHMS:
            raise ValueError(
                f"px.BucketedSync: algorithm={self.algorithm!r} must be one of "
                f"{', '.join(map(repr, SYNC_ALGORITHMS))}: 'xla' for XLA's all-reduce, or a "
                "point-to-point algorithm of parallax.comm.")

    @property
    def varying_results(self) -> bool:
        """Whether the sums come back typed varying over the batch axes (point-to-point
        algorithms): equal on every device, but not provably so to JAX's type checker."""
        return self.algorithm != "xla"

    def __call__(self, grads: list[jax.Array], axes: tuple[str, ...]) -> list[jax.Array]:
        return bucket.bucketed_all_reduce(
            list(grads), axes if len(axes) > 1 else axes[0], bucket_bytes=self.bucket_bytes,
            reverse=self.reverse, algorithm=self.algorithm, compression=self.compression,
            packing=self.packing)
