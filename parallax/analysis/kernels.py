"""Which attention kernel a compiled program runs, read from its HLO.

``parallax.attention`` computes attention under the scope ``parallax.attention[<kernel>]``,
which XLA keeps in each instruction's ``op_name`` metadata; the fused kernels are custom
calls: cuDNN's flash attention ``__cudnn$fmha...`` (forward and backward), a Pallas TPU
kernel ``tpu_custom_call``. Reading both tells what parallax asked for and whether the fused
kernel is really in the program (on GPU the check that the cuDNN call is the one running).

Example:
  >>> import jax, jax.numpy as jnp
  >>> from parallax.attention import dot_product_attention
  >>> from parallax.analysis.kernels import attention_kernels
  >>> q = jnp.ones((1, 8, 2, 16))
  >>> found = attention_kernels(jax.jit(dot_product_attention).lower(q, q, q).compile())
  >>> found.kernels, found.summary()
  (('xla',), 'xla')
"""

from __future__ import annotations

import dataclasses
import re

_TAG = re.compile(r"parallax\.attention\[(\w+)\]")
_CUSTOM_CALL = re.compile(r'custom_call_target="([^"]+)"')
CUDNN_ATTENTION = "__cudnn$fmha"
TPU_KERNEL = "tpu_custom_call"


def _text(program) -> str:
    if isinstance(program, str):
        return program
    if hasattr(program, "compile") and not hasattr(program, "memory_analysis"):
        program = program.compile()  # a Lowered
    return program.as_text()


@dataclasses.dataclass(frozen=True)
class AttentionKernels:
    """What a program's attention runs.

    Attributes:
      tagged: ``{kernel: instructions}`` under parallax's ``parallax.attention[...]`` scopes.
      cudnn_calls: cuDNN fused-attention custom calls (forward and backward).
      tpu_calls: Pallas TPU custom calls inside parallax's attention scopes.
    """

    tagged: dict[str, int]
    cudnn_calls: int
    tpu_calls: int

    @property
    def kernels(self) -> tuple[str, ...]:
        """The kernels parallax's attention asked for, sorted (empty: no attention found)."""
        return tuple(sorted(self.tagged))

    def summary(self) -> str:
        """One line: the kernels and the fused calls found (``"none"`` without attention).

        A kernel asked for whose fused call is missing says so: that is the failure the
        GPU check looks for.
        """
        if not self.tagged and not self.cudnn_calls:
            return "none"
        parts = []
        for kernel in self.kernels or ("cudnn",):
            if kernel == "cudnn":
                parts.append(f"cudnn ({self.cudnn_calls} fused calls)" if self.cudnn_calls
                             else "cudnn (NO fused call in the program)")
            elif kernel == "pallas":
                parts.append(f"pallas ({self.tpu_calls} TPU kernel calls)" if self.tpu_calls
                             else "pallas (interpreted: no TPU kernel call)")
            else:
                parts.append(kernel)
        return ", ".join(parts)


def attention_kernels(program) -> AttentionKernels:
    """The attention kernels of a ``Compiled`` (or ``Lowered``, or HLO text).

    Args:
      program: the compiled step (``step.lower(state, batch).compile()``) or its text.

    Returns:
      An :class:`AttentionKernels`.
    """
    tagged: dict[str, int] = {}
    cudnn = tpu = 0
    for line in _text(program).splitlines():
        tag = _TAG.search(line)
        if tag:
            tagged[tag.group(1)] = tagged.get(tag.group(1), 0) + 1
        target = _CUSTOM_CALL.search(line)
        if target and target.group(1).startswith(CUDNN_ATTENTION):
            cudnn += 1
        elif target and target.group(1) == TPU_KERNEL and tag:
            tpu += 1
    return AttentionKernels(tagged, cudnn, tpu)
