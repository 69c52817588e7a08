"""parallax.analysis.kernels reads which attention kernel a program runs."""

import jax
import jax.numpy as jnp

from parallax.analysis.kernels import attention_kernels
from parallax.attention import dot_product_attention

# Two lines as XLA's GPU compiler writes cuDNN's fused attention (forward and backward).
GPU_HLO = """
%custom-call.1 = (bf16[4,16,2048,64]{3,2,1,0}, f32[4,16,2048]{2,1,0}, u8[0]{0}) custom-call(%p0, %p1, %p2), custom_call_target="__cudnn$fmhaSoftmax", metadata={op_name="jit(step)/jvp(parallax.attention[cudnn])/dot_product_attention"}
%custom-call.2 = (bf16[4,16,2048,64]{3,2,1,0}, bf16[4,16,2048,64]{3,2,1,0}, u8[0]{0}) custom-call(%a, %b), custom_call_target="__cudnn$fmhaSoftmaxBackward", metadata={op_name="jit(step)/transpose(jvp(parallax.attention[cudnn]))/dot_product_attention"}
"""


def test_the_fused_cudnn_calls_are_counted():
    found = attention_kernels(GPU_HLO)
    assert found.kernels == ("cudnn",) and found.cudnn_calls == 2
    assert found.summary() == "cudnn (2 fused calls)"


def test_a_cudnn_request_without_its_call_is_reported():
    # What the GPU check looks for: parallax asked for cuDNN but XLA runs something else.
    text = GPU_HLO.replace("__cudnn$fmha", "__other")
    assert attention_kernels(text).summary() == "cudnn (NO fused call in the program)"


def test_a_cpu_program_runs_xla_and_a_program_without_attention_none():
    q = jnp.ones((2, 8, 4, 16))
    grad = jax.jit(jax.grad(lambda q: dot_product_attention(q, q[:, :, :2], q[:, :, :2]).sum()))
    assert attention_kernels(grad.lower(q)).summary() == "xla"
    assert attention_kernels(jax.jit(jnp.sin).lower(q).compile()).summary() == "none"
