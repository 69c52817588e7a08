"""The plan of one model, on one screen: every parameter of GPT tiny and where it lives
under DP 2 x FSDP 2 x TP 2, as torchtitan writes a layer plan.

Read a row as: the stacked blocks' leading ``layers`` axis is never split (each scan
iteration reads one layer locally); tensor parallelism splits heads, the MLP width and the
vocabulary over ``tensor`` (the fused q/k/v kernel and ``fc`` by columns, ``out`` and ``proj`` by
rows); ZeRO 3 then shards the largest dimension still free over ``fsdp``; ``data`` holds
full replicas. Trailing unsharded dimensions are left out, as JAX prints shardings.
"""

from flax import nnx
from jax import P

import parallax as px
from parallax import layout
from parallax.rules import readable_path

PLAN = {
    "['blocks']['attn']['out']['bias']": P(None, "fsdp"),                  # (L, D)
    "['blocks']['attn']['out']['kernel']": P(None, "tensor", None, "fsdp"),  # (L, H, hd, D)
    "['blocks']['attn']['qkv']['kernel']": P(None, "fsdp", None, "tensor"),  # (L, D, 3, H, hd)
    "['blocks']['attn']['query_bias']": P(None, "tensor", "fsdp"),         # (L, H, hd)
    "['blocks']['attn']['value_bias']": P(None, "tensor", "fsdp"),         # (L, H, hd)
    "['blocks']['ln1']['bias']": P(None, "fsdp"),                          # (L, D)
    "['blocks']['ln1']['scale']": P(None, "fsdp"),
    "['blocks']['ln2']['bias']": P(None, "fsdp"),
    "['blocks']['ln2']['scale']": P(None, "fsdp"),
    "['blocks']['mlp']['fc']['bias']": P(None, "tensor"),                  # (L, F): no dim left
    "['blocks']['mlp']['fc']['kernel']": P(None, "fsdp", "tensor"),        # (L, D, F)
    "['blocks']['mlp']['proj']['bias']": P(None, "fsdp"),                  # (L, D)
    "['blocks']['mlp']['proj']['kernel']": P(None, "tensor", "fsdp"),      # (L, F, D)
    "['ln_f']['bias']": P("fsdp"),                                         # (D,)
    "['ln_f']['scale']": P("fsdp"),
    "['wpe']": P("fsdp"),                                                  # (T, D)
    "['wte']": P("tensor", "fsdp"),                                        # (V, D), tied head
}


def test_the_plan_of_gpt_tiny_under_dp_fsdp_tp():
    mesh = px.make_mesh(data=2, fsdp=2, tensor=2)
    strategy = px.compose(px.DataParallel("data"), px.FSDP("fsdp"), px.TensorParallel("tensor"))
    model = nnx.eval_shape(lambda: px.models.GPT(px.models.GPTConfig.tiny(), rngs=nnx.Rngs(0)))
    lays = layout.param_layouts(nnx.state(model, nnx.Param), strategy, mesh, "test")
    plan = {readable_path(lay.path): layout.canonical(lay.spec("param"), mesh) for lay in lays}
    assert plan == PLAN
