"""Grouped-query attention under tensor parallelism: K/V heads split when the tensor size
divides them, kept whole when it does not.

``px.models.Llama`` (4 query heads, 2 key/value heads): over 2 ranks each holds one key/value
head, 1/2 of the K/V parameters, and the layer moves only ``[B, T, D]`` all-reduces (no K/V
gathered); over 4 ranks the 2 heads are kept whole on every
rank. Training equals one device both ways: ``tests/models/test_llama.py``
(``test_dp_fsdp_tp_trains_like_one_device``: tensor 2, split;
``test_tensor_and_sequence_parallel_train_like_one_device``: tensor 4, whole).
"""

import functools

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import parallax as px
from parallax.analysis import tensor_traffic as traffic
from parallax.models import Llama, LlamaConfig, next_token_loss

CONFIG = LlamaConfig.tiny()  # H = 4 query heads, G = 2 key/value heads
L, D, G, K = CONFIG.num_layers, CONFIG.embed_dim, CONFIG.num_kv_heads, CONFIG.head_dim
B, T = 4, 16


@functools.cache
def _setup(tensor):
    mesh = px.make_mesh(tensor=tensor, devices=jax.devices()[:tensor])
    strategy = px.TensorParallel("tensor")
    state = px.init(lambda: px.TrainState.create(Llama(CONFIG, rngs=nnx.Rngs(0)),
                                                 optax.sgd(0.1)), mesh, strategy)
    return mesh, strategy, state


@pytest.mark.parametrize("tensor, per_device", [(2, 1 / 2), (4, 1)], ids=["split", "whole"])
def test_key_value_parameters_per_device(tensor, per_device):
    _, _, state = _setup(tensor)
    kv = state.params["blocks"]["attn"]["key_value"]["kernel"][...]  # [L, D, 2, G, K]
    assert kv.shape == (L, D, 2, G, K)
    for shard in kv.addressable_shards:
        assert shard.data.size == kv.size * per_device
        assert shard.data.shape == (L, D, 2, int(G * per_device), K)  # whole heads of k and v
    # The query heads split either way.
    query = state.params["blocks"]["attn"]["query"]["kernel"][...]
    assert {s.data.size for s in query.addressable_shards} == {query.size // tensor}


@pytest.mark.slow
def test_split_heads_are_never_gathered():
    # Each rank's query heads read its own key/value head: the layer body moves only
    # [B, T, D] all-reduces over tensor. Forward: attention's and the MLP's (Megatron's two).
    # Backward: the MLP's, and the input gradients of q and of the fused k/v reduced in one
    # combined all-reduce of two arrays (q has a kernel of its own, see
    # parallax/nn/llama_layers.py); the unsplit layout of before reduced five arrays here.
    mesh, strategy, state = _setup(2)

    @px.train_step(mesh, strategy)
    def step(state, batch):
        loss, grads = px.value_and_grad(next_token_loss)(state.model, batch)
        return state.apply_gradients(grads), {"loss": loss}

    compiled = step.lower(state, {"tokens": np.zeros((B, T + 1), np.int32)}).compile()
    layer = [tc for tc in traffic.tensor_collectives(compiled, mesh)
             if tc.in_loop and "chunked_cross_entropy" not in tc.collective.op_name]
    assert all(tc.collective.count == L for tc in layer)
    for phase, arrays in (("forward", 2), ("backward", 3)):
        found = sorted((tc.collective.kind, shape) for tc in layer if tc.phase == phase
                       for shape in tc.collective.shapes)
        assert found == [("all-reduce", (B, T, D))] * arrays, phase
    assert not [c for c in traffic.tensor_collectives(compiled, mesh)
                if c.collective.kind == "all-gather"]


def test_the_layer_choice_follows_the_sizes():
    # px.TensorParallel's per-array choice: split when the size divides the heads, else None.
    from parallax.strategies.tensor import KeyValueHeads

    names = ("layers", "embed", None, "kv_heads", "kv")
    choose = KeyValueHeads("tensor")
    for tensor, heads, want in ((2, 2, "kv_heads"), (4, 8, "kv_heads"), (4, 2, None),
                                (8, 1, None)):
        mesh = px.make_mesh(tensor=tensor, devices=jax.devices()[:tensor])
        assert choose(names, (L, D, 2, heads, K), mesh)[3] == want
