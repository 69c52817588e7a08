"""``px.ContextParallel`` inside ``px.Pipeline`` stages: data x stage x context.

Each case trains 3 steps of a tiny model (T = 16) split into pipeline stages, with the
sequence split over ``context`` inside each stage, and must match one device: losses,
gradients, parameters and the whole final state (optimizer included), fp32, 1e-5. The
compiled program must send the ring's messages inside the stages as all-to-alls over
``context`` (no collective-permute over it: see
``parallax.strategies.context_parallel.stage_groups``), 3n - 2 per layer per micro-batch pass,
and gather no activation over ``context`` inside the layers.
"""

import functools

import fixtures as fx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import parallax as px
from parallax.analysis import hlo
from parallax.models.gpt_pipeline import next_token_stages
from parallax.models.llama import llama_stages

STEPS, B, T, MICRO = 3, 4, 16, 2
GPT = px.models.GPTConfig.tiny(max_seq_len=T)
LLAMA = px.models.LlamaConfig.tiny(max_seq_len=T)

# Each case compiles a pipeline with context parallelism in its stages (8 to 20 s of one core,
# docs/design.md "Test suite time"): the module runs in the full suite only.
pytestmark = pytest.mark.slow

# name -> (family, mesh axes, method, schedule)
CASES = {
    "gpt-ring-gpipe-pp2-cp2": ("gpt", {"stage": 2, "context": 2}, "ring", "gpipe"),
    "gpt-all_gather-1f1b-pp2-cp2": ("gpt", {"stage": 2, "context": 2}, "all_gather", "1f1b"),
    "gpt-ring-1f1b-dp2-pp2-cp2": ("gpt", {"data": 2, "stage": 2, "context": 2}, "ring",
                                  "1f1b"),
    "llama-ring-zb_h1-pp2-cp2": ("llama", {"stage": 2, "context": 2}, "ring", "zb_h1"),
}
SLOW = {"gpt-ring-1f1b-dp2-pp2-cp2", "llama-ring-zb_h1-pp2-cp2"}


def make_state(family):
    if family == "llama":
        model = px.models.Llama(LLAMA, rngs=nnx.Rngs(0))
    else:
        model = px.models.GPT(GPT, rngs=nnx.Rngs(0))
    return px.TrainState.create(model, fx.GPT_TX)  # momentum SGD (fixtures.GPT_TX says why)


def strategy_for(axes, method, schedule):
    parts = [px.Pipeline("stage", microbatches=MICRO, schedule=schedule),
             px.ContextParallel("context", method=method)]
    if "data" in axes:
        parts.insert(0, px.DataParallel("data"))
    return px.compose(*parts)


def mesh_for(axes):
    return px.make_mesh(devices=jax.devices()[: int(np.prod(list(axes.values())))], **axes)


@functools.cache
def reference(family):
    """Batches and the one-device run of the unpipelined loss, per model family."""
    vocab = (LLAMA if family == "llama" else GPT).vocab_size
    rng = np.random.default_rng(0)
    batches = [{"tokens": rng.integers(0, vocab, (B, T + 1)).astype(np.int32)}
               for _ in range(STEPS)]
    return batches, px.testing.train(lambda: make_state(family), px.models.next_token_loss,
                                     batches)


def params(name):
    marks = [pytest.mark.slow] if name in SLOW else []
    return pytest.param(name, marks=marks, id=name)


@pytest.mark.parametrize("name", [params(n) for n in CASES])
def test_matches_one_device(name):
    family, axes, method, schedule = CASES[name]
    batches, ref = reference(family)
    stages = llama_stages if family == "llama" else next_token_stages
    par = px.testing.train(lambda: make_state(family), stages, batches, mesh=mesh_for(axes),
                           strategy=strategy_for(axes, method, schedule))
    px.testing.assert_equivalent(par, ref, rtol=1e-5)
    whole = px.testing.relative_difference(jax.tree.leaves(jax.device_get(par.final_state)),
                                           jax.tree.leaves(jax.device_get(ref.final_state)))
    assert whole <= 1e-5, f"final state (params and optimizer) differs by {whole:.2e}"


@pytest.mark.slow
def test_ring_messages_stay_inside_the_stages():
    """GPT, stage=2 x context=4, 1F1B (remat "except_last"): per layer, the forward action
    sends n - 1 K/V blocks, the backward 2n - 1 (n - 1 of K/V, n of their float32
    gradients), the rematerialised forward n - 1 again: 3n - 2 per micro-batch pass (plus
    n - 1 when it is recomputed), each an all-to-all over ``context`` of n slots (one stays
    on the device). The only collective-permute left is the pipeline's own over ``stage``;
    what is all-gathered over ``context`` is in ``first``/``last`` (the embedding's
    gradients), never in the layers; the labels' shift is local (no halo over ``context``)."""
    axes = {"stage": 2, "context": 4}
    n = axes["context"]
    mesh, strategy = mesh_for(axes), strategy_for(axes, "ring", "1f1b")

    @px.train_step(mesh, strategy)
    def step(state, batch):
        loss, grads = px.value_and_grad(next_token_stages)(state.model, batch)
        return state.apply_gradients(grads), loss

    batch = {"tokens": jax.ShapeDtypeStruct((B, T + 1), jnp.int32)}
    found = hlo.collectives(step.lower(jax.eval_shape(lambda: make_state("gpt")),
                                       batch).compile(), mesh)
    assert {c.axes for c in found if c.kind == "collective-permute"} == {("stage",)}
    ctx = [c for c in found if c.axes == ("context",)]
    layers = [c for c in ctx if "pp_first" not in c.op_name and "pp_last" not in c.op_name]
    assert not [c.op_name for c in layers if c.kind == "all-gather"]
    ring = [c for c in layers if c.kind == "all-to-all"]
    forward = [c for c in ring if "pp_F/" in c.op_name]
    remat = [c for c in ring if "pp_remat" in c.op_name]
    backward = [c for c in ring if "transpose(" in c.op_name]
    assert (len(forward), len(backward), len(remat), len(ring)) == (n - 1, 2 * n - 1, n - 1,
                                                                    4 * n - 3)
    rows = B // MICRO
    kv = 2 * rows * (T // n) * GPT.num_heads * GPT.head_dim * 4  # a device's K and V, f32
    assert {sum(np.prod(s) * 4 for s in c.shapes) for c in ring} == {n * kv}


def test_compose_keeps_refusing_megatron_sequence_parallelism():
    with pytest.raises(ValueError, match=r"splits the sequence over 'tensor' and "
                       r"ContextParallel\('context'\).*sequence_parallel=False"):
        px.compose(px.Pipeline("stage", microbatches=2), px.ContextParallel(),
                   px.TensorParallel(sequence_parallel=True))
