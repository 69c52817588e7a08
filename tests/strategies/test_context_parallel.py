"""Context parallelism (``px.ContextParallel``) on the GPT: ring and all-gather attention.

Each case trains 3 steps of the tiny causal GPT and must match one device (losses, first
gradients, final parameters and the whole final state; fp32, 1e-5). The compiled program
of the ring must hold the collective-permutes of the ring formula, the all-gather method
its all-gathers, and the ring's per-step work is the same on every device.
"""

import functools

import fixtures as fx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import parallax as px
from parallax.analysis import hlo
from parallax.strategies.context_parallel import ring as context_ring
from parallax.strategies.context_parallel import zigzag as context_zigzag

CONFIG = fx.GPT_CONFIG
B, T, D, L, H = 4, CONFIG.max_seq_len, CONFIG.embed_dim, CONFIG.num_layers, CONFIG.num_heads
STEPS = 3

# Every test here but the refusals compiles context-parallel programs (3 to 18 s of one core
# each, docs/design.md "Test suite time"): the module runs in the full suite only.
pytestmark = pytest.mark.slow

# name -> (mesh axes, method, with DataParallel and TensorParallel)
CASES = {
    "ring-cp2": ({"context": 2}, "ring"),
    "all_gather-cp2": ({"context": 2}, "all_gather"),
    "ring-cp4": ({"context": 4}, "ring"),
    "all_gather-cp4": ({"context": 4}, "all_gather"),
    "ring-dp2-cp2-tp2": ({"data": 2, "context": 2, "tensor": 2}, "ring"),
    "all_gather-dp2-cp2-tp2": ({"data": 2, "context": 2, "tensor": 2}, "all_gather"),
    "ring-fsdp2-cp2": ({"fsdp": 2, "context": 2}, "ring"),
}
SLOW = {"all_gather-cp4", "all_gather-dp2-cp2-tp2", "ring-fsdp2-cp2"}


def strategy_for(axes, method):
    parts = [px.ContextParallel("context", method=method)]
    if "data" in axes:
        parts.insert(0, px.DataParallel("data"))
    if "fsdp" in axes:
        parts.insert(0, px.FSDP("fsdp"))
    if "tensor" in axes:
        parts.append(px.TensorParallel("tensor"))
    return px.compose(*parts)


def mesh_for(axes):
    return px.make_mesh(devices=jax.devices()[: int(np.prod(list(axes.values())))], **axes)


@functools.cache
def data():
    batches = fx.gpt_batches(steps=STEPS, batch=B)
    return batches, px.testing.train(fx.gpt_state, px.models.next_token_loss, batches)


def params(name):
    marks = [pytest.mark.slow] if name in SLOW else []
    return pytest.param(name, marks=marks, id=name)


@pytest.mark.parametrize("name", [params(n) for n in CASES])
def test_gpt_matches_one_device(name):
    axes, method = CASES[name]
    batches, ref = data()
    par = px.testing.train(fx.gpt_state, px.models.next_token_loss, batches,
                           mesh=mesh_for(axes), strategy=strategy_for(axes, method))
    px.testing.assert_equivalent(par, ref, rtol=1e-5)
    whole = px.testing.relative_difference(jax.tree.leaves(jax.device_get(par.final_state)),
                                           jax.tree.leaves(jax.device_get(ref.final_state)))
    assert whole <= 1e-5, f"final state (params and optimizer) differs by {whole:.2e}"


@functools.cache
def compiled(axes_items, method):
    axes = dict(axes_items)
    mesh, strategy = mesh_for(axes), strategy_for(axes, method)
    state = px.init(fx.gpt_state, mesh, strategy)

    @px.train_step(mesh, strategy)
    def step(state, batch):
        loss, grads = px.value_and_grad(px.models.next_token_loss)(state.model, batch)
        return state.apply_gradients(grads), loss

    return mesh, step.lower(state, data()[0][0]).compile()


def context_collectives(mesh, program, kind):
    """Count and bytes of ``kind`` that context parallelism's own shard_maps issue (GSPMD
    adds a halo exchange of a few token ids for the labels' shift, not counted)."""
    found = [c for c in hlo.collectives(program, mesh)
             if c.axes == ("context",) and "shard_map" in c.op_name]
    return hlo.count(found, kind), hlo.total_bytes(found, kind)


@pytest.mark.parametrize("n", [2, 4])
def test_ring_messages_match_the_formula(n):
    """Per layer: forward n-1 shifts of K and V; backward n-1 of K and V and n of their
    gradients (float32). Once per step: the exchange back to natural order (2 messages of
    half a device's hidden states; one for n = 2, whose even chunks stay) and its transpose
    in the backward pass."""
    mesh, program = compiled((("context", n),), "ring")
    kv = 2 * B * (T // n) * H * (D // H) * 4  # one device's K and V, float32
    half = B * (T // (2 * n)) * D * 4
    count, total = context_collectives(mesh, program, "collective-permute")
    natural = 2 * (1 if n == 2 else 2)
    assert count == L * (3 * n - 2) + natural
    assert total == L * (3 * n - 2) * kv + natural * half


def test_all_gather_messages_match_the_formula():
    """Per layer: K and V all-gathered once forward and once more in the backward (which
    recomputes the attention), their gradients reduce-scattered once."""
    n = 4
    mesh, program = compiled((("context", n),), "all_gather")
    full_kv = 2 * B * T * H * (D // H) * 4
    assert context_collectives(mesh, program, "all-gather") == (2 * L, 2 * L * full_kv)
    assert context_collectives(mesh, program, "reduce-scatter") == (L, L * full_kv)


def _subjaxprs(eqn):
    for value in eqn.params.values():
        for sub in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(sub, jax.extend.core.Jaxpr):
                yield sub
            elif isinstance(getattr(sub, "jaxpr", None), jax.extend.core.Jaxpr):
                yield sub.jaxpr


def _dot_flops(jaxpr) -> int:
    """Multiply-add flops (x2) of every dot_general in ``jaxpr`` and the jaxprs it calls."""
    flops = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            flops += 2 * int(np.prod(eqn.outvars[0].aval.shape)) * int(
                np.prod([lhs[d] for d in contract]))
        flops += sum(_dot_flops(sub) for sub in _subjaxprs(eqn))
    return flops


def _cond_branches(jaxpr):
    """``[[branch jaxpr, ...], ...]`` of every ``cond`` in ``jaxpr`` and what it calls."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "cond":
            found.append([b.jaxpr for b in eqn.params["branches"]])
        else:
            for sub in _subjaxprs(eqn):
                found.extend(_cond_branches(sub))
    return found


@pytest.mark.parametrize("n", [2, 4])
def test_ring_work_is_balanced(n):
    """Causal zigzag: every device has the same visible query-key pairs, and after its own
    block each ring step computes the same scores whichever case (earlier or later chunk)
    the device is in: both branches of each step's ``cond`` do the same matmul work,
    forward and backward, half of the own block's."""
    assert len(set(context_zigzag.visible_pairs(n, 4).tolist())) == 1
    c, heads, k = 4, 2, 8
    mesh = jax.make_mesh((n,), ("context",), axis_types=(jax.sharding.AxisType.Auto,))
    kw = dict(axis="context", n=n, causal=True, scale=0.5)
    spec = jax.P(None, "context")

    def loss(q):
        out = context_ring.ring_attention(q, q, q, **kw)
        return jnp.sum(out)

    f = jax.shard_map(jax.grad(loss), mesh=mesh, in_specs=spec, out_specs=spec)
    jaxpr = jax.make_jaxpr(f)(jnp.ones((1, 2 * c * n, heads, k))).jaxpr
    branches = _cond_branches(jaxpr)
    assert len(branches) == 2 * (n - 1)  # one per ring step after the first, fwd and bwd
    for earlier, later in branches:
        assert _dot_flops(earlier) == _dot_flops(later) > 0
    pairs = 2 * c * c  # half of the own block's (2c)^2 query-key pairs
    # forward: scores and output (2 matmuls); backward: scores, dV, dP, dQ, dK (5)
    assert {_dot_flops(b[0]) for b in branches} == {2 * 2 * pairs * k * heads,
                                                     5 * 2 * pairs * k * heads}


def test_zigzag_round_trip():
    n, length = 4, 16
    pos = context_zigzag.positions(length, n)
    assert sorted(pos.tolist()) == list(range(length))
    assert pos[: length // n].tolist() == [0, 1, 14, 15]
    mesh = jax.make_mesh((n,), ("context",), axis_types=(jax.sharding.AxisType.Auto,))
    spec = jax.P(None, "context")
    there = jax.shard_map(lambda x: context_zigzag.to_natural(x, "context", n), mesh=mesh,
                          in_specs=spec, out_specs=spec)
    back = jax.shard_map(lambda x: context_zigzag.to_zigzag(x, "context", n), mesh=mesh,
                         in_specs=spec, out_specs=spec)
    zig = jnp.asarray(pos)[None]
    assert there(zig).tolist() == [list(range(length))]
    assert back(there(zig)).tolist() == zig.tolist()


def test_sequence_length_that_does_not_split_is_refused():
    mesh = mesh_for({"context": 4})
    strategy = px.ContextParallel()
    state = px.init(fx.gpt_state, mesh, strategy)

    @px.train_step(mesh, strategy)
    def step(state, batch):
        loss, grads = px.value_and_grad(px.models.next_token_loss)(state.model, batch)
        return state.apply_gradients(grads), loss

    tokens = jnp.zeros((B, 13), jnp.int32)  # 12 positions: not a multiple of 2 x 4
    with pytest.raises(ValueError, match=r"GPT.embed: sequence length 12 does not split into "
                       r"the 2 x 4 = 8 equal chunks of px.ContextParallel\('context'\).*"
                       r"multiple of 8, e.g. 16"):
        step(state, {"tokens": tokens})


def test_compose_refuses_what_cannot_mix():
    with pytest.raises(ValueError, match=r"splits the sequence over 'tensor' and "
                       r"ContextParallel\('context'\).*sequence_parallel=False"):
        px.compose(px.ContextParallel(), px.TensorParallel(sequence_parallel=True))
    with pytest.raises(ValueError, match="both split the sequence's attention"):
        px.compose(px.ContextParallel(), px.ContextParallel("sequence"))


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"px.ContextParallel: method='flash' must be one of"):
        px.ContextParallel(method="flash")
    with pytest.raises(TypeError, match=r"px.ContextParallel: axis must be a mesh axis name"):
        px.ContextParallel(axis=2)


@pytest.mark.slow
def test_benchmark_runs_and_memory_falls(capsys):
    """benchmarks/context_parallel.py at T = 1024: attention temp memory per
    device falls at least as 1/CP for both methods."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[2] / "benchmarks" / "context_parallel.py"
    spec = importlib.util.spec_from_file_location("cp_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--lengths", "1024"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    ratios = {(r[1], int(r[2])): float(r[4]) for r in rows if r[1] in ("ring", "all_gather")}
    for method in ("ring", "all_gather"):
        for n in (2, 4):
            assert ratios[(method, n)] <= 1.1 / n, (method, n, ratios)


@pytest.mark.parametrize("method", ["ring", pytest.param("all_gather", marks=pytest.mark.slow)])
def test_llama_matches_one_device(method):
    """Llama reads RoPE positions, token ids and its output order through parallax.attention:
    grouped-query attention and rotary positions under the zigzag split."""
    from flax import nnx

    config = px.models.LlamaConfig.tiny(max_seq_len=16)

    def make_state():  # SGD with momentum, as the GPT's cases (fixtures.GPT_TX says why)
        return px.TrainState.create(px.models.Llama(config, rngs=nnx.Rngs(0)), fx.GPT_TX)

    rng = np.random.default_rng(0)
    batches = [{"tokens": rng.integers(0, config.vocab_size, (4, 17)).astype(np.int32)}
               for _ in range(STEPS)]
    ref = px.testing.train(make_state, px.models.next_token_loss, batches)
    axes = {"data": 2, "context": 2, "tensor": 2}
    par = px.testing.train(make_state, px.models.next_token_loss, batches,
                           mesh=mesh_for(axes), strategy=strategy_for(axes, method))
    px.testing.assert_equivalent(par, ref, rtol=1e-5)
    whole = px.testing.relative_difference(jax.tree.leaves(jax.device_get(par.final_state)),
                                           jax.tree.leaves(jax.device_get(ref.final_state)))
    assert whole <= 1e-5, f"final state (params and optimizer) differs by {whole:.2e}"


THREE_D = {"data": 2, "context": 2, "tensor": 2}
OWN = {"all_gather", "reduce_scatter", "ppermute"}  # ContextParallel's own shard_map ops


@functools.cache
def compiled_3d(family, method):
    """(mesh, program, config) of one step under data=2 x context=2 x tensor=2."""
    from flax import nnx

    if family == "llama":
        config = px.models.LlamaConfig.tiny(max_seq_len=16)
        make = lambda: px.TrainState.create(px.models.Llama(config, rngs=nnx.Rngs(0)),
                                            fx.GPT_TX)
    else:
        config, make = CONFIG, fx.gpt_state
    mesh, strategy = mesh_for(THREE_D), strategy_for(THREE_D, method)
    state = jax.eval_shape(make)
    batch = {"tokens": jax.ShapeDtypeStruct((B, config.max_seq_len + 1), jnp.int32)}

    @px.train_step(mesh, strategy)
    def step(state, batch):
        loss, grads = px.value_and_grad(px.models.next_token_loss)(state.model, batch)
        return state.apply_gradients(grads), loss

    return mesh, step.lower(state, batch).compile(), config


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ring", "all_gather"])
@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_context_with_tensor_moves_only_the_attention_messages(family, method):
    """Under context x tensor parallelism no layer all-gathers an activation's sequence
    over ``context`` (the heads and MLP hidden stay split by sequence), and the attention's
    own messages carry each device's G/t key/value heads only: per layer, the all-gather
    method gathers K and V twice and reduce-scatters their gradients once; the ring sends
    3n - 2 blocks. What GSPMD still gathers over ``context`` runs once per step, outside
    the layers (the logits and the embedding's and head's gradients, docs/context_parallel.md;
    the logits a chunk at a time in the loss's loop over sequence chunks)."""
    mesh, program, config = compiled_3d(family, method)
    n, t, rows = THREE_D["context"], THREE_D["tensor"], B // THREE_D["data"]
    seq, layers = config.max_seq_len, config.num_layers
    groups = getattr(config, "num_kv_heads", config.num_heads)
    full_kv = 2 * rows * seq * (groups // t) * config.head_dim * 4  # K and V, float32
    found = [c for c in hlo.collectives(program, mesh) if c.axes == ("context",)]
    own = [c for c in found if c.op_name.rsplit("/", 1)[-1] in OWN and c.count == layers]
    gspmd = [c for c in found if c not in own and c.kind == "all-gather"
             and "chunked_cross_entropy" not in c.op_name]  # the loss's loop over chunks
    assert all(c.count == 1 for c in gspmd), [(c.shapes, c.op_name) for c in gspmd
                                               if c.count != 1]
    if method == "all_gather":
        assert (hlo.count(own, "all-gather"), hlo.total_bytes(own, "all-gather")) == (
            2 * layers, 2 * layers * full_kv)
        assert (hlo.count(own, "reduce-scatter"), hlo.total_bytes(own, "reduce-scatter")) \
            == (layers, layers * full_kv)
    else:
        assert hlo.count(own, "all-gather") == 0
        assert hlo.total_bytes(own, "collective-permute") == layers * (3 * n - 2) * full_kv // n
