"""Which attention kernel runs: cuDNN's fused attention on NVIDIA GPUs, Pallas on TPUs, XLA.

:func:`choose_kernel` is a pure function of the backend, the dtype and the shapes (call it
with ``"gpu"`` or ``"tpu"`` anywhere); :func:`run` computes attention with the kernel
chosen, under a ``jax.named_scope`` (``parallax.attention[<kernel>]``) that the compiled
program keeps, so :func:`parallax.analysis.kernels.attention_kernels` can read which one a
program runs. The rules, as the kernels' own checks state them:

- ``"cudnn"``: ``jax.nn.dot_product_attention(..., implementation="cudnn")``, cuDNN's
  flash attention, on an NVIDIA GPU of compute capability 8.0 or later, with
  bfloat16/float16 inputs and a head size that is a multiple of 8 up to 128 (256 from
  compute capability 9.0, Hopper). It takes K/V with fewer heads than Q (grouped-query
  attention) as they are: nothing is repeated.
- ``"pallas"``: the splash attention kernel jax ships in
  ``jax.experimental.pallas.ops.tpu.splash_attention`` (jax 0.10.2 and 0.12.1 both do), on
  a TPU, when both sequence lengths are multiples of 128 (its blocks), and where no mesh
  axis is manual: the explicit style's ``shard_map`` checks varying axes, which a Pallas
  call's outputs do not carry, so a TPU step gets it with ``style="gspmd"`` (the XLA kernel
  runs in the explicit style). Inside a step it runs in its own ``shard_map`` over the axes
  that split the batch and the heads. Grouped-query attention maps each query head to its
  K/V head inside the kernel. On CPU it runs in Pallas' interpreter: slow, for tests only,
  never chosen by ``"auto"``. Not run on a TPU yet.
- ``"xla"``: ``jax.nn.dot_product_attention``'s XLA implementation (the ``[T, S]`` scores
  are materialised); on CPU, on other GPUs, in float32, and wherever the others do not fit.

``"auto"`` takes the first that fits, in the order above. A kernel asked for by name that
cannot run raises, naming the rule it breaks.

References:
  Dao et al., "FlashAttention", 2022 and "FlashAttention-2", 2023; NVIDIA cuDNN's fused
  flash attention (``jax._src.cudnn.fused_attention_stablehlo.check_is_flash_attention``
  holds the head-size rule); the splash attention kernel of jax's Pallas TPU ops.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from parallax import context
from parallax.rules import resolve_spec

KERNELS = ("auto", "xla", "cudnn", "pallas")
FUSED_DTYPES = ("bfloat16", "float16")
SPLASH_BLOCK = 128
QUERY_NAMES = ("batch", "length", "heads", "kv")  # as the models constrain q, k and v
KV_NAMES = ("batch", "length", "kv_heads", "kv")


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """A kernel and why it was taken (or why a faster one was not)."""

    kernel: str
    reason: str


def check_kernel(value, api: str) -> str:
    """``value`` if it names a kernel, else a ValueError naming the choices."""
    if value not in KERNELS:
        raise ValueError(f"{api}: attention={value!r} is not an attention kernel; use one of "
                         f"{KERNELS} ('auto' picks per backend: see parallax.attention_kernel).")
    return value


def pallas_available() -> bool:
    """Whether the installed jax ships the Pallas TPU splash attention kernel."""
    try:
        from jax.experimental.pallas.ops.tpu.splash_attention import (  # noqa: F401
            splash_attention_kernel)
    except ImportError:
        return False
    return True


def _cudnn_misfit(dtype: str, head_dim: int, capability: tuple[int, int] | None) -> str:
    if capability is not None and capability < (8, 0):
        return f"compute capability {capability[0]}.{capability[1]} (it needs 8.0 or later)"
    if dtype not in FUSED_DTYPES:
        return f"{dtype} inputs (it takes bfloat16 or float16)"
    most = 256 if capability is not None and capability >= (9, 0) else 128
    if head_dim % 8 or head_dim > most:
        return f"head size {head_dim} (it takes a multiple of 8 up to {most})"
    return ""


def _pallas_misfit(query_len: int, key_len: int, available: bool, manual) -> str:
    if not available:
        return "this jax ships no Pallas TPU splash attention"
    if manual:
        return (f"a manual mesh axis ({', '.join(sorted(manual))}): the explicit style's "
                "shard_map checks varying axes, which a Pallas call's outputs lack (use "
                "style='gspmd')")
    if query_len % SPLASH_BLOCK or key_len % SPLASH_BLOCK:
        return f"sequence lengths {query_len}, {key_len} (it takes multiples of {SPLASH_BLOCK})"
    return ""


def choose_kernel(platform: str, dtype, *, head_dim: int, query_len: int, key_len: int,
                  requested: str = "auto", compute_capability: str | None = None,
                  pallas: bool | None = None, manual_axes: frozenset[str] = frozenset(),
                  masked: bool = False,
                  api: str = "parallax.attention.dot_product_attention") -> KernelChoice:
    """The attention kernel for a backend, dtype and shape: a pure function.

    Args:
      platform: ``"cpu"``, ``"gpu"`` (NVIDIA, CUDA), ``"rocm"`` or ``"tpu"``.
      dtype: the query's dtype.
      head_dim: K, the size of one head.
      query_len, key_len: T and S.
      requested: ``"auto"`` or a kernel's name (see :data:`KERNELS`).
      compute_capability: the GPU's (``"9.0"``), when known.
      pallas: whether jax ships the Pallas TPU kernel (None: look).
      manual_axes: mesh axes manual where attention runs (inside the explicit style's
        ``shard_map``). A Pallas call's outputs carry no varying-axes type, which that
        ``shard_map`` checks, so the Pallas kernel runs only where none is manual.
      masked: a document mask (packed ``segment_ids``) comes with the call; only XLA's
        kernel is given it so far (cuDNN's and splash's segment forms are not wired).
      api: named in errors.

    Returns:
      A :class:`KernelChoice`.

    Raises:
      ValueError: ``requested`` names a kernel that cannot run here (the message says why).

    Example:
      >>> import jax.numpy as jnp
      >>> choose_kernel("gpu", jnp.bfloat16, head_dim=64, query_len=2048, key_len=2048).kernel
      'cudnn'
      >>> choose_kernel("gpu", jnp.float32, head_dim=64, query_len=2048, key_len=2048).reason
      'cuDNN does not fit: float32 inputs (it takes bfloat16 or float16)'
      >>> choose_kernel("cpu", jnp.bfloat16, head_dim=64, query_len=64, key_len=64).kernel
      'xla'
    """
    check_kernel(requested, api)
    dtype = jnp.dtype(dtype).name
    capability = (tuple(int(p) for p in str(compute_capability).split(".")[:2])
                  if compute_capability else None)
    misfits = {
        "cudnn": (f"the backend is {platform} (it runs on an NVIDIA GPU)" if platform != "gpu"
                  else _cudnn_misfit(dtype, head_dim, capability)),
        "pallas": (f"the backend is {platform} (it runs on a TPU, or interpreted on CPU)"
                   if platform not in ("tpu", "cpu") else
                   _pallas_misfit(query_len, key_len,
                                  pallas_available() if pallas is None else pallas, manual_axes)),
        "xla": "",
    }
    if masked:
        packed = "packed documents (segment_ids) mask only in XLA's kernel so far"
        misfits = {k: (why or packed) if k != "xla" else why for k, why in misfits.items()}
    if requested != "auto":
        why = misfits[requested]
        if why:
            raise ValueError(f"{api}: attention kernel {requested!r} cannot run here: {why}. "
                             "Use 'auto' (the fastest that fits) or 'xla'.")
        interpreted = requested == "pallas" and platform == "cpu"
        return KernelChoice(requested, "asked for" + (" (Pallas interpreter: slow, for tests)"
                                                      if interpreted else ""))
    if platform == "gpu":
        why = misfits["cudnn"]
        return KernelChoice("xla", f"cuDNN does not fit: {why}") if why else \
            KernelChoice("cudnn", "fused flash attention (NVIDIA GPU, " + dtype + ")")
    if platform == "tpu":
        why = misfits["pallas"]
        return KernelChoice("xla", f"Pallas splash does not fit: {why}") if why else \
            KernelChoice("pallas", "Pallas splash attention (TPU)")
    return KernelChoice("xla", f"no fused kernel on {platform}")


def device_facts(device=None) -> tuple[str, str | None]:
    """``(platform, compute_capability)`` of ``device`` (default: the first device) as
    :func:`choose_kernel` takes them: ``"gpu"`` means an NVIDIA GPU, ``"rocm"`` an AMD one.

    Example:
      >>> device_facts()[0] in ("cpu", "gpu", "rocm", "tpu")
      True
    """
    device = device if device is not None else jax.devices()[0]
    platform = device.platform
    if platform == "gpu":
        version = str(getattr(device.client, "platform_version", "")).lower()
        platform = "rocm" if "rocm" in version else "gpu"
    if platform == "cuda":
        platform = "gpu"
    return platform, getattr(device, "compute_capability", None)


def choose_for(query: jax.Array, key: jax.Array, requested: str, api: str, *,
               masked: bool = False) -> KernelChoice:
    """:func:`choose_kernel` for these arrays on the step's devices (else the default ones)."""
    ctx = context.current()
    platform, capability = device_facts(ctx.mesh.devices.flat[0] if ctx is not None else None)
    return choose_kernel(platform, query.dtype, head_dim=query.shape[-1],
                         query_len=query.shape[1], key_len=key.shape[1], requested=requested,
                         compute_capability=capability,
                         manual_axes=ctx.manual_axes if ctx is not None else frozenset(),
                         masked=masked, api=api)


def run(kernel: str, query, key, value, *, causal: bool, scale: float | None,
        mask: jax.Array | None = None) -> jax.Array:
    """Attention ``[B, T, H, K] x [B, S, G, K] -> [B, T, H, K]`` with ``kernel``, tagged in the
    compiled program by the scope ``parallax.attention[<kernel>]``; ``mask`` (bool, broadcast
    to ``[B, H, T, S]``) only with ``"xla"``."""
    with jax.named_scope(f"parallax.attention[{kernel}]"):
        if kernel == "pallas":
            return _splash(query, key, value, causal=causal, scale=scale)
        implementation = "cudnn" if kernel == "cudnn" else None
        return jax.nn.dot_product_attention(query, key, value, mask=mask, scale=scale,
                                            is_causal=causal, implementation=implementation)


def _splash_call(q, k, v, *, causal: bool, scale: float, interpret: bool):
    """Splash attention on local arrays ``[B, T, H, K]``, ``[B, S, G, K]``."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as kernels, splash_attention_mask as masks)

    (_, t, h, _), s = q.shape, k.shape[1]
    one = masks.CausalMask((t, s)) if causal else masks.FullMask((t, s))
    block = max(b for b in (512, 256, SPLASH_BLOCK) if t % b == 0 and s % b == 0)
    sizes = kernels.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                               block_q_dkv=block, block_kv_dkv=block,
                               block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    attend = kernels.make_splash_mha(masks.MultiHeadMask([one] * h), block_sizes=sizes,
                                     head_shards=1, q_seq_shards=1, interpret=interpret)
    heads_first = functools.partial(jnp.swapaxes, axis1=1, axis2=2)  # [B, H, T, K]
    # The kernel does not scale the logits: the query is scaled first (as MaxText does).
    out = jax.vmap(attend)(heads_first(q * jnp.asarray(scale, q.dtype)), heads_first(k),
                           heads_first(v))
    return heads_first(out)


def _splash(query, key, value, *, causal: bool, scale: float | None):
    """Splash attention; inside a step, in a ``shard_map`` over the axes that split the batch
    and the heads (a Pallas kernel is one device's program: GSPMD cannot split it)."""
    scale = 1.0 / float(np.sqrt(query.shape[-1])) if scale is None else float(scale)
    interpret = device_facts()[0] != "tpu"
    call = functools.partial(_splash_call, causal=causal, scale=scale, interpret=interpret)
    ctx = context.current()
    if ctx is None:
        return call(query, key, value)
    rules, mesh = ctx.strategy.activation_rules, ctx.mesh
    q_spec = resolve_spec(QUERY_NAMES, query.shape, rules, mesh, api="parallax.attention")
    kv_names = ctx.strategy.model_hooks.choose_names(KV_NAMES, key.shape, mesh)  # GQA splits
    kv_spec = resolve_spec(kv_names, key.shape, rules, mesh, api="parallax.attention")
    axes = [a for e in (q_spec[0], q_spec[2]) for a in ((e,) if isinstance(e, str) else e or ())]
    if not axes:
        return call(query, key, value)
    heads = q_spec[2]
    kv_heads = kv_spec[2] if kv_spec[2] == heads else None  # else K/V whole, sliced below
    q_in, kv_in = jax.P(q_spec[0], None, heads, None), jax.P(q_spec[0], None, kv_heads, None)

    def local(q, k, v):
        if heads is not None and kv_heads is None:  # this rank's query heads' K/V heads
            per_kv = query.shape[2] // key.shape[2]
            first = _first_head(heads, q.shape[2]) // per_kv
            count = max(1, q.shape[2] // per_kv)
            k = jax.lax.dynamic_slice_in_dim(k, first, count, axis=2)
            v = jax.lax.dynamic_slice_in_dim(v, first, count, axis=2)
        return call(q, k, v)

    # check_vma=False: a Pallas call's outputs carry no varying-axes type.
    mapped = jax.shard_map(local, in_specs=(q_in, kv_in, kv_in), out_specs=q_in,
                           axis_names=frozenset(axes), check_vma=False)
    with context.manual(axes):
        return mapped(query, key, value)


def _first_head(heads, local_heads: int):
    """The global index of this rank's first query head (heads split over ``heads``)."""
    names = (heads,) if isinstance(heads, str) else tuple(heads)
    rank = 0
    for name in names:
        rank = rank * jax.lax.axis_size(name) + jax.lax.axis_index(name)
    return rank * local_heads
