"""A step's time on a cluster: matmuls, memory-bound work, the bubble, each level's traffic.

The roofline (:mod:`parallax.planner.roofline`) bounds a step by the larger of its flops
over the peak and its bytes over the memory bandwidth. On a GPU the matmuls and the
memory-bound operations (normalisations, activation functions, softmax, the optimizer's
update) run as separate kernels, one after another, so their times add. With a
:class:`parallax.planner.topology.Topology` a step is estimated as

    (matmul flops / (peak x efficiency) + memory-bound bytes / HBM bandwidth) / (1 - bubble)
      + the collectives' time, inside a node and across nodes

with no communication overlapped (parallax's runtime and XLA's collectives run between
computations; an overlapping implementation is faster than this):

- **matmul flops**: :func:`parallax.planner.predicted.compute.flops` (``6 N + 12 L T D`` per
  token, plus the forwards a pipeline recomputes), at the chip's ``matmul_efficiency``: the
  fraction of its peak a large bf16 matmul reaches, one measured figure per chip, cited in
  ``roofline.CHIPS`` (not fitted to any run this estimate is compared with);
- **memory-bound bytes**: every activation a layer saves for its backward (Korthikanti's
  accounting, :func:`parallax.planner.predicted.memory.layer_activations`) is written and read
  in the forward, and read in the backward where its gradient is written and read: 5 passes,
  2 more where the forward is recomputed. The attention's ``a s² b / t`` scores have more
  kernels over them (``jax.nn.dot_product_attention``'s XLA implementation, which the
  reference models call): the ``QK`` matmul writes the logits in float32, softmax reads them
  and writes the probabilities in the compute dtype, the ``PV`` matmul reads those; the
  backward writes and reads the probabilities' gradient, reads the probabilities, writes the
  logits' gradient in float32 and both matmuls read it: ``8 + 2 e`` bytes per score forward
  (again where recomputed) and ``12 + 3 e`` backward. The loss's probabilities take 5
  passes; with micro-batches (a pipeline, or accumulation) every micro-batch reads and
  writes the float32 gradient accumulators; the optimizer reads the gradients and reads
  and writes its parameters and moments;
- **collectives**: :func:`parallax.planner.predicted.traffic.collectives`, each priced per
  level by the topology (rings in a node; rings or trees across nodes; the hierarchical
  all-reduce where a group spans both);
- **bubble**: the schedule's (:func:`parallax.planner.predicted.compute.bubble`).

Every term is per device, averaged over a pipeline's stages. MFU is the model's flops (no
recomputation) over the time and the peak (PaLM's definition).

References:
  Williams et al., "Roofline", CACM 2009; Korthikanti et al., "Reducing Activation
  Recomputation in Large Transformer Models", 2022; Narayanan et al., SC 2021; Chowdhery et
  al., "PaLM", 2022, appendix B (MFU).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from parallax.planner import roofline
from parallax.planner.predicted import compute, memory, traffic
from parallax.planner.setting import StepSetting
from parallax.planner.topology import INTER, INTRA, Topology

PASSES = {"saved": 5, "recomputed": 2, "head": 5}
LOGITS_BYTES = 4  # jax.nn.dot_product_attention's logits are float32 whatever the dtype


def score_bytes(itemsize: int) -> tuple[int, int]:
    """Bytes moved per attention score: ``(forward, backward)`` (module docstring)."""
    return 2 * LOGITS_BYTES + 2 * itemsize, 3 * LOGITS_BYTES + 3 * itemsize


@dataclasses.dataclass(frozen=True)
class StepSplit:
    """A step's estimated time, by part, in seconds (see the module docstring).

    Attributes:
      matmul: the matmuls at the chip's achievable rate.
      memory_bound: the memory-bound work at the HBM bandwidth.
      bubble_fraction: the pipeline's idle fraction (0 without a pipeline).
      communication: seconds by level (``"intra-node"``, ``"inter-node"``), nothing
        overlapped.
      model_flops: the model's flops per device (no recomputation), for MFU.
      peak_flops: the chip's peak for the step's dtype.
      collectives: ``[(kind, axes, message bytes, count, {level: seconds})]``.
    """

    matmul: float
    memory_bound: float
    bubble_fraction: float
    communication: dict
    model_flops: float
    peak_flops: float
    collectives: tuple = ()

    @property
    def compute(self) -> float:
        return self.matmul + self.memory_bound

    @property
    def bubble(self) -> float:
        """Seconds idle in the bubble: ``compute x f / (1 - f)``."""
        f = self.bubble_fraction
        return self.compute * f / (1 - f) if f < 1 else float("inf")

    @property
    def exposed(self) -> float:
        return sum(self.communication.values())

    @property
    def total(self) -> float:
        return self.compute + self.bubble + self.exposed

    @property
    def mfu(self) -> float:
        return self.model_flops / self.total / self.peak_flops if self.total else 0.0


def memory_bound_bytes(s: StepSetting, activations: float | None = None) -> float:
    """Bytes the memory-bound work of a step moves on one device (module docstring).

    ``activations`` stands in for the saved activations of a model with no formula (the
    plain step's residuals on one device's rows).

    Example:
      >>> import jax, jax.numpy as jnp, optax, parallax as px
      >>> from flax import nnx
      >>> from parallax.planner.setting import read_setting
      >>> state = jax.eval_shape(lambda: px.TrainState.create(
      ...     px.models.GPT(px.models.GPTConfig.tiny(), rngs=nnx.Rngs(0)), optax.adam(1e-3)))
      >>> s = read_setting(px.make_mesh(data=8), px.DataParallel("data"), state,
      ...                  {"tokens": jax.ShapeDtypeStruct((8, 65), jnp.int32)})
      >>> memory_bound_bytes(s) > 0
      True
    """
    state = memory.state_bytes(s)
    optimizer = (state["gradients"].value + 2 * state["parameters"].value
                 + 2 * state["optimizer state"].value)
    micro = s.pipeline.microbatches if s.pipeline else s.accumulation
    if micro > 1:  # every micro-batch adds into the float32 accumulators
        optimizer += 2 * micro * sum(x.nbytes / x.rule_ways * 4 / x.itemsize for x in s.leaves
                                     if x.role == "param")
    terms = memory.layer_activations(s, s.rows_per_device)
    if terms is None:
        return optimizer + PASSES["saved"] * (activations or 0.0)
    p = s.pipeline
    again = p.remat_fraction if p is not None else 0.0
    layers = s.config.num_layers / s.stages
    e = jnp.dtype(s.config.dtype).itemsize
    forward, backward = score_bytes(e)
    per_layer = (terms.rest * (PASSES["saved"] + again * PASSES["recomputed"])
                 + terms.scores / e * ((1 + again) * forward + backward))
    return optimizer + layers * per_layer + PASSES["head"] * terms.head / s.stages


def estimate(s: StepSetting, topology: Topology, device: roofline.Chip | str | None = None, *,
             flops: float | None = None, activations: float | None = None) -> StepSplit:
    """The :class:`StepSplit` of a step on ``topology`` (its own chip unless ``device``).

    Args:
      s: the step's setting (any mesh shape: nothing is compiled).
      topology: the cluster.
      device: the chip, when not the topology's.
      flops: the matmul flops per device, for a model with no formula.
      activations: its saved activations per device (the plain step's residuals).

    Returns:
      A :class:`StepSplit`.

    Example:
      >>> import jax, jax.numpy as jnp, optax, parallax as px
      >>> from flax import nnx
      >>> from jax.sharding import AbstractMesh, AxisType
      >>> from parallax.planner.setting import read_setting
      >>> from parallax.planner.topology import cluster
      >>> config = px.models.GPTConfig.gpt2_350m(dtype=jnp.bfloat16)
      >>> state = jax.eval_shape(lambda: px.TrainState.create(
      ...     px.models.GPT(config, rngs=nnx.Rngs(0)), optax.adamw(1e-4)))
      >>> mesh = AbstractMesh((64,), ("data",), (AxisType.Auto,))   # 8 DGX H100 nodes
      >>> s = read_setting(mesh, px.DataParallel("data"), state,
      ...                  {"tokens": jax.ShapeDtypeStruct((512, 1025), jnp.int32)},
      ...                  backend="gpu")
      >>> split = estimate(s, cluster("dgx-h100"))
      >>> split.communication["inter-node"] > 0 and 0 < split.mfu < 1
      True
    """
    total = compute.flops(s)
    matmuls = total.value if total is not None else (flops or 0.0)
    model = compute.flops(s, recomputed=False)
    found = [(kind, axes, t.message_bytes, max(t.count, 1))
             for (kind, axes), t in traffic.collectives(s).items()]
    return price(s, topology, device, matmuls, found,
                 model.value if model is not None else matmuls, activations)


def price(s: StepSetting, topology: Topology, device: roofline.Chip | str | None,
          matmul_flops: float, found, model_flops: float,
          activations: float | None = None) -> StepSplit:
    """A :class:`StepSplit` from a step's matmul flops and collectives ``(kind, axes,
    message bytes, count)``: the predicted ones (:func:`estimate`) or a compiled program's
    (``px.plan`` prices its compiled candidates so)."""
    chip = roofline.chip(device or topology.chip)
    dtype = jnp.dtype(s.config.dtype).name if s.config is not None else "float32"
    if getattr(s.strategy, "float8", None) is not None:
        # px.Float8: the matmuls at the chip's float8 peak. All of them, attention's and
        # the loss head's included, which stay bfloat16: an optimistic bound.
        dtype = "float8"
    peak = chip.flops_per_second(dtype)
    bubble = compute.bubble(s)
    priced, levels = [], {INTRA: 0.0, INTER: 0.0}
    for kind, axes, nbytes, count in found:
        seconds = topology.collective_seconds(kind, axes, s.mesh_shape, nbytes, count)
        priced.append((kind, axes, nbytes, count, seconds))
        for level, t in seconds.items():
            levels[level] += t
    return StepSplit(matmul_flops / (peak * chip.matmul_efficiency),
                     memory_bound_bytes(s, activations) / chip.hbm_bandwidth,
                     bubble.value if bubble is not None else 0.0, levels, model_flops, peak,
                     tuple(priced))
