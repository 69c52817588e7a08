"""Megatron tensor and sequence parallelism on the GPT, in both styles.

GSPMD style: ``px.models.GPT`` under ``px.TensorParallel`` rules. Explicit style:
``px.nn.ParallelGPT`` (the same parameters) inside ``px.nn.tensor_parallel``. Each case
trains 5 steps and must match one device (losses, first gradients, final parameters;
fp32, 1e-5), and its compiled program must communicate what Megatron says: per layer two
all-reduces of ``[B, T, D]`` forward and two backward, or with sequence parallelism
all-gather / reduce-scatter pairs moving the same bytes. One compiled program per case
serves both checks. (GSPMD TP 4 alone, DP x TP and DP x FSDP x TP 2 without sequence
parallelism are in test_equivalence.py.)
"""

import functools
import math

import fixtures as fx
import jax
import numpy as np
import pytest
from flax import nnx

import parallax as px
from parallax.analysis import hlo
from parallax.analysis import tensor_traffic as traffic
from parallax.strategies import tensor as tp

CONFIG = fx.GPT_CONFIG
B, T, D, L = 16, CONFIG.max_seq_len, CONFIG.embed_dim, CONFIG.num_layers
# name -> (style, mesh axes, sequence parallel)
CASES = {
    "gspmd-tp4-sp": ("gspmd", {"tensor": 4}, True),
    "explicit-tp4": ("explicit", {"tensor": 4}, False),
    "explicit-tp2-sp": ("explicit", {"tensor": 2}, True),
    "gspmd-fsdp-tp": ("gspmd", {"fsdp": 2, "tensor": 4}, False),
    "gspmd-dp-fsdp-tp-sp": ("gspmd", {"data": 2, "fsdp": 2, "tensor": 2}, True),
    "explicit-dp-fsdp-tp": ("explicit", {"data": 2, "fsdp": 2, "tensor": 2}, False),
}


def strategy_for(axes, sequence_parallel):
    parts = [px.DataParallel("data")] if "data" in axes else []
    parts += [px.FSDP("fsdp")] if "fsdp" in axes else []
    return px.compose(*parts, px.TensorParallel("tensor", sequence_parallel=sequence_parallel))


def model_for(style, sequence_parallel):
    """(make_state, loss_fn) of one style; both start from the same parameters."""
    if style == "gspmd":
        return fx.gpt_state, px.models.next_token_loss
    def make():
        model = px.nn.ParallelGPT(CONFIG, rngs=nnx.Rngs(0), sequence_parallel=sequence_parallel)
        return px.TrainState.create(model, fx.GPT_TX)
    return make, px.nn.tensor_parallel(px.nn.parallel_next_token_loss)


@functools.cache
def case(name):
    """(trajectory, compiled step, mesh, examples per tensor group) for a case, once."""
    style, axes, sequence_parallel = CASES[name]
    mesh = px.make_mesh(devices=jax.devices()[: math.prod(axes.values())], **axes)
    strategy = strategy_for(axes, sequence_parallel)
    make, loss_fn = model_for(style, sequence_parallel)
    _, _, data, _, _ = fx.reference("gpt")
    state = px.init(make, mesh, strategy)

    @px.train_step(mesh, strategy)
    def step(state, batch):
        loss, grads = px.value_and_grad(loss_fn)(state.model, batch)
        return state.apply_gradients(grads), {"loss": loss, "grads": grads}

    compiled = step.lower(state, data[0]).compile()
    losses, first = [], None
    with jax.set_mesh(mesh):
        for batch in data:
            state, metrics = compiled(state, batch)
            losses.append(float(metrics["loss"]))
            first = jax.device_get(metrics["grads"]) if first is None else first
    run = px.testing.Trajectory(losses, first, jax.device_get(state.params), state)
    groups = math.prod(size for axis, size in axes.items() if axis != "tensor")
    return run, compiled, mesh, B // groups


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_gpt_matches_one_device(name):
    run, *_ = case(name)
    px.testing.assert_equivalent(run, fx.reference("gpt")[-1], rtol=1e-5)


def in_the_loss(tc):
    """The chunked loss's loop over sequence chunks (px.nn.chunked_cross_entropy)."""
    return "chunked_cross_entropy" in tc.collective.op_name


def _in_layer(name, phase):
    """The arrays the scan body moves over ``tensor`` in one phase: activations and others.

    Activations are ``[B, ...]`` arrays (XLA may combine several arrays, e.g. an activation
    gradient and a LayerNorm gradient, into one tuple all-reduce; each is counted).
    """
    run, compiled, mesh, batch = case(name)
    found = [tc.collective for tc in traffic.tensor_collectives(compiled, mesh)
             if tc.in_loop and tc.phase == phase and not in_the_loss(tc)]
    assert all(c.count == L for c in found)  # the body runs once per layer
    arrays = [(c.kind, shape) for c in found for shape in c.shapes]
    activations = sorted(a for a in arrays if len(a[1]) == 3 and a[1][0] == batch)
    small = [a for a in arrays if not (len(a[1]) == 3 and a[1][0] == batch)]
    return activations, small, batch


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gspmd-fsdp-tp", "explicit-tp4"])
@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_two_all_reduces_per_layer_and_phase(name, phase):
    activations, small, b = _in_layer(name, phase)
    assert activations == [("all-reduce", (b, T, D))] * 2
    assert not small


@pytest.mark.slow
@pytest.mark.parametrize("name", ["explicit-tp2-sp", "gspmd-tp4-sp"])
@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_sequence_parallel_turns_them_into_reduce_scatter_all_gather_pairs(name, phase):
    activations, small, b = _in_layer(name, phase)
    n = case(name)[2].shape["tensor"]
    gathers = [("all-gather", (b, T, D))] * 2
    if name.startswith("explicit"):
        assert activations == gathers + [("reduce-scatter", (b, T // n, D))] * 2
    else:
        # The CPU compiler leaves GSPMD's reduce-scatter as an all-reduce + dynamic-slice
        # (GPU and TPU fuse them); the explicit style issues the reduce-scatter itself.
        assert activations == gathers + [("all-reduce", (b, T, D))] * 2
    # Only sequence-parallel LayerNorm / bias gradients ([D] vectors) are reduced besides.
    assert all(math.prod(shape) == D for _, shape in small)
    assert phase == "backward" or not small


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_bytes_equal_the_megatron_formula(name):
    _, compiled, mesh, batch = case(name)
    sp = CASES[name][2]
    measured = traffic.measured_traffic(compiled, mesh, batch)
    expected = traffic.megatron_traffic(CONFIG, batch, T, sequence_parallel=sp)
    if name.startswith("gspmd") and sp:  # reduce-scatters compiled as all-reduces on CPU
        measured = traffic.TensorTraffic(all_gather=measured.all_gather,
                              all_reduce=measured.all_reduce + measured.reduce_scatter)
        expected = traffic.TensorTraffic(all_gather=expected.all_gather,
                              all_reduce=expected.all_reduce + expected.reduce_scatter)
    assert measured == expected


@pytest.mark.slow
def test_sequence_parallel_moves_the_same_bytes_per_layer():
    def per_layer_wire(name):
        run, compiled, mesh, batch = case(name)
        n = mesh.shape["tensor"]
        total = 0.0
        for tc in traffic.tensor_collectives(compiled, mesh):
            c = tc.collective
            # the layers' [B, T(/n), D] messages (not the chunked loss's [B, T / chunks])
            if tc.in_loop and c.shapes[0][0] == batch and c.shapes[0][-1] == D:
                factor = 2 if c.kind == "all-reduce" else 1
                total += factor * (n - 1) / n * c.message_bytes * c.count
        return total / L / ((n - 1) / n * batch * T * D * 4)  # in ring units of [B, T, D]

    assert per_layer_wire("explicit-tp4") == per_layer_wire("explicit-tp2-sp") == 8.0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gspmd-fsdp-tp", "gspmd-tp4-sp", "explicit-tp4"])
def test_no_device_holds_the_full_logits(name):
    # [B, T, V] = f32[b,64,256] appears nowhere (the MLP hidden [b, 64, 256] is split too).
    # GSPMD: the loss takes 4 chunks of 16 positions, each device's chunk logits are
    # [b, 16, 64] (V / 4); the explicit layers' logits are [b, 64, 64].
    _, compiled, _, b = case(name)
    text = compiled.as_text()
    chunk = f"f32[{b},16,64]" if name.startswith("gspmd") else f"f32[{b},64,64]"
    assert f"f32[{b},64,256]" not in text and chunk in text


@pytest.mark.slow
def test_vocab_parallel_loss_holds_no_ranks_logits_whole():
    # One layer and a 4096-token vocabulary, so that the logits dominate the temporaries.
    # loss_chunks=1 is the loss before chunking: each rank's [B, T, V / 4] logits at once.
    def program(chunks):
        config = px.models.GPTConfig.tiny(num_layers=1, vocab_size=4096, loss_chunks=chunks)
        model = px.nn.ParallelGPT(config, rngs=nnx.Rngs(0))
        batch = {"tokens": np.zeros((8, T + 1), np.int32)}
        mesh = px.make_mesh(tensor=4, devices=jax.devices()[:4])
        explicit = px.nn.tensor_parallel(px.nn.parallel_next_token_loss, mesh=mesh)
        return jax.jit(jax.grad(explicit)).lower(model, batch).compile()

    chunked, whole = program(None), program(1)
    assert "f32[8,64,1024]" in whole.as_text()  # this rank's vocabulary slice, every position
    text = chunked.as_text()
    assert "f32[8,64,1024]" not in text and "f32[8,64,4096]" not in text
    # the logits and their gradient dominated a rank's temporaries; chunked, about a third
    # of them is left (measured 2.8 MB of 8.7 MB on jax 0.10.2)
    assert hlo.memory(chunked).temp_bytes < hlo.memory(whole).temp_bytes / 2


# ---- bad input: pinned messages ----------------------------------------------------------

def _mesh4():
    return px.make_mesh(tensor=4, devices=jax.devices()[:4])


def _gpt_state(**overrides):
    config = px.models.GPTConfig.tiny(num_layers=1, **overrides)
    return lambda: px.TrainState.create(px.models.GPT(config, rngs=nnx.Rngs(0)), fx.GPT_TX)


def _explicit(**overrides):
    config = px.models.GPTConfig.tiny(num_layers=1, **overrides)
    model = px.nn.ParallelGPT(config, rngs=nnx.Rngs(0), sequence_parallel=True)
    loss = px.nn.tensor_parallel(px.nn.parallel_next_token_loss, mesh=_mesh4())
    return lambda tokens: loss(model, {"tokens": tokens})


TOKENS = np.zeros((2, 17), np.int32)
# what -> (overrides, the parameter's path, what every API says after "<api>: <path>")
INDIVISIBLE = {
    "heads": (dict(num_heads=2), r"\['blocks'\]\['attn'\]\['out'\]\['kernel'\]",
              r" has shape \(1, 2, 32, 64\): its 'heads' dimension 1 has 2 entries, which do "
              r"not split over the tensor axis tensor=4. Fix: use a number of attention heads "
              r"that is a multiple of 4, or a tensor axis dividing 2."),
    "mlp": (dict(mlp_dim=250), r"\['blocks'\]\['mlp'\]\['fc'\]\['bias'\]",
            r" has shape \(1, 250\): its 'mlp' dimension 1 has 250 entries, which do not split "
            r"over the tensor axis tensor=4. Fix: use an MLP width \(mlp_dim\) that is a "
            r"multiple of 4, or a tensor axis dividing 250."),
    "vocab": (dict(vocab_size=250), r"\['wte'\]",
              r" has shape \(250, 64\): its 'vocab' dimension 0 has 250 entries, which do not "
              r"split over the tensor axis tensor=4. Fix: pad the vocabulary to a multiple of 4: "
              r"GPTConfig\(vocab_pad_multiple=4\) or VocabParallelEmbedding\(..., "
              r"pad_to_multiple_of=4\); padded logits are masked, so the loss is unchanged."),
}


@pytest.mark.parametrize("what", INDIVISIBLE)
def test_indivisible_heads_mlp_and_vocabulary(what):
    # Both styles, and the check on its own, give Megatron's fix; px.init runs it before
    # the generic layout check (ModelHooks.param_checks).
    overrides, path, message = INDIVISIBLE[what]
    with pytest.raises(ValueError, match=r"px.init: \.params" + path + message):
        px.init(_gpt_state(**overrides), _mesh4(), px.TensorParallel("tensor"))
    with pytest.raises(ValueError, match=r"px.nn.tensor_parallel: " + path + message):
        _explicit(**overrides)(TOKENS)
    model = px.models.GPT(px.models.GPTConfig.tiny(num_layers=1, **overrides), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"px.TensorParallel: " + path + message):
        tp.check_params(nnx.state(model, nnx.Param), _mesh4())


def test_the_check_is_a_value_that_composition_keeps():
    strategy = px.compose(px.DataParallel("data"), px.TensorParallel("tensor"))
    assert strategy.model_hooks.param_checks == (tp.MegatronCheck("tensor"),)
    assert strategy.model_hooks.name_choices == (tp.KeyValueHeads("tensor"),)
    assert px.TensorParallel("tensor") == px.TensorParallel("tensor")
    # GSPMD: key/value heads split when 4 divides them and stay whole otherwise (GSPMD
    # computes attention with whole K/V for any count): never refused.
    for heads in (8, 2, 3):
        tp.MegatronCheck("tensor")(("embed", "kv_heads", "kv"), (48, heads, 8), _mesh4())


@pytest.mark.slow
def test_padding_the_vocabulary_fixes_it():
    state = px.init(_gpt_state(vocab_size=250, vocab_pad_multiple=4), _mesh4(),
                    px.TensorParallel("tensor"))
    assert state.params["wte"][...].shape == (252, 64)
    assert state.params["wte"][...].sharding.spec == jax.P("tensor")


@pytest.mark.slow
def test_sequence_not_divisible_under_sequence_parallelism():
    mesh, strategy = _mesh4(), px.TensorParallel("tensor", sequence_parallel=True)
    state = px.init(_gpt_state(), mesh, strategy)

    @px.train_step(mesh, strategy)
    def step(state, batch):
        loss, grads = px.value_and_grad(px.models.next_token_loss)(state.model, batch)
        return state.apply_gradients(grads), {"loss": loss}

    with pytest.raises(ValueError, match=(
            r"GPT.embed: sequence length 63 does not split into the 4 parts of sequence "
            r"parallelism \(tensor=4 in TensorParallel\('tensor', sequence_parallel=True\)\); "
            r"use a multiple of 4, e.g. 64 \(next_token_loss takes tokens \[batch, length \+ 1\]\)"
            r", or turn sequence_parallel off.")):
        step(state, {"tokens": np.zeros((4, 64), np.int32)})
    with pytest.raises(ValueError, match=(
            r"px.nn.scatter_to_sequence: the activation of shape \(2, 63, 64\) has 63 positions "
            r"along dimension 1, which does not split over tensor=4 ranks; use a sequence length "
            r"that is a multiple of the tensor-parallel size")):
        _explicit()(np.zeros((2, 64), np.int32))


@pytest.mark.slow
def test_key_value_heads_that_neither_split_nor_replicate():
    attn = px.nn.ParallelSelfAttention(48, 6, num_kv_heads=3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=(
            r"px.nn.param_specs: \['key_value'\]\['kernel'\] has shape \(48, 2, 3, 8\): its "
            r"'kv_heads' dimension 2 has 3 entries, which do not split over the tensor axis "
            r"tensor=4. Fix: "
            r"use a number of key/value heads that divides 4 or is a multiple of it.")):
        px.nn.param_specs(nnx.state(attn, nnx.Param), _mesh4())
    # Placed by hand without splitting the heads, the layer itself refuses.
    attn = px.nn.ParallelSelfAttention(32, 2, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(attn, nnx.Param)
    f = jax.shard_map(lambda p, x: nnx.merge(graphdef, p)(x), mesh=_mesh4(),
                      in_specs=(jax.P(), jax.P()), out_specs=jax.P())
    with pytest.raises(ValueError, match=(
            r"ParallelSelfAttention: num_heads=2 is not divisible by the tensor-parallel size "
            r"tensor=4; each rank needs a whole number of heads")):
        f(params, np.zeros((1, 4, 32), np.float32))
