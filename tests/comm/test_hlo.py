"""What the algorithms put on the wire, read from the compiled HLO on 8 devices.

Every claim is measured with parallax.analysis.hlo on the partitioned program. Bytes are
what one device sends: for a collective-permute, its result (the message) per execution.
"""

import math

import jax
import jax.numpy as jnp
import pytest

from .comm_testing import grid_mesh, line_mesh
from parallax import comm
from parallax.analysis import hlo

P = jax.P


def compiled(mesh, body, *args, spec=None, options=None):
    spec = P(mesh.axis_names) if spec is None else spec
    f = jax.jit(jax.shard_map(lambda *a: body(*a), mesh=mesh, in_specs=spec, out_specs=spec))
    return hlo.collectives(f.lower(*args).compile(compiler_options=options), mesh)


@pytest.mark.parametrize("size", [1000, 1001])
def test_ring_all_reduce_is_2_n_minus_1_permutes_of_s_over_n(mesh8, size):
    n = 8
    found = compiled(mesh8, lambda v: comm.ring_all_reduce(v, "x"), jnp.ones(n * size))
    perms = [c for c in found if c.kind == "collective-permute"]
    assert len(found) == len(perms) == hlo.count(found, "collective-permute") == 2 * (n - 1)
    chunk = math.ceil(size / n)
    assert all(c.shapes == ((chunk,),) and c.dtype == "f32" and c.axes == ("x",)
               for c in perms)
    assert all(sorted(c.pairs) == [(i, (i + 1) % n) for i in range(n)] for c in perms)
    sent = hlo.total_bytes(found, "collective-permute")
    assert sent == 2 * (n - 1) * chunk * 4
    if size % n == 0:
        assert sent == 2 * (n - 1) / n * size * 4        # 2(N-1)/N * S per device


def test_ring_reduce_scatter_and_all_gather_are_n_minus_1_steps(mesh8):
    found = compiled(mesh8, lambda v: comm.ring_all_gather(comm.ring_reduce_scatter(v, "x"), "x"),
                     jnp.ones((8 * 64, 3)))
    assert hlo.count(found, "collective-permute") == 14
    assert all(c.shapes == ((8, 3),) for c in found)


@pytest.mark.parametrize("n,rounds", [(8, 3), (4, 2), (2, 1), (6, 4), (3, 3)])
def test_tree_all_reduce_has_log2_n_rounds(n, rounds):
    size = 100
    found = compiled(line_mesh(n), lambda v: comm.tree_all_reduce(v, "x"), jnp.ones(n * size))
    assert hlo.count(found, "collective-permute") == rounds == len(comm.tree_rounds(n))
    assert all(c.kind == "collective-permute" and c.shapes == ((size,),) for c in found)
    if n == 8:
        assert rounds == math.log2(n)
        assert {frozenset(c.pairs) for c in found} == {
            frozenset((i, i ^ b) for i in range(8)) for b in (1, 2, 4)}


@pytest.mark.parametrize("outer,inner", [(2, 4), (4, 2)])
def test_hierarchical_moves_s_over_inner_across_the_outer_axis(outer, inner):
    size = 1024  # elements per device
    found = compiled(grid_mesh(outer, inner),
                     lambda v: comm.hierarchical_all_reduce(v, "tensor", "data"),
                     jnp.ones(8 * size))
    by_kind = {c.kind: c for c in found}
    assert sorted(by_kind) == ["all-gather", "all-reduce", "reduce-scatter"]
    assert by_kind["reduce-scatter"].axes == ("tensor",)
    assert by_kind["reduce-scatter"].message_bytes == size * 4
    assert by_kind["all-reduce"].axes == ("data",)
    assert by_kind["all-reduce"].message_bytes == size * 4 // inner      # S / inner
    assert by_kind["all-gather"].axes == ("tensor",)
    assert hlo.total_bytes(found, axes="data") == size * 4 // inner
    # a flat all-reduce over both axes would carry all of S
    flat = compiled(grid_mesh(outer, inner), lambda v: comm.all_reduce(v, ("data", "tensor")),
                    jnp.ones(8 * size))
    assert hlo.total_bytes(flat, axes=("data", "tensor")) == size * 4


def test_bucketed_all_reduce_issues_ceil_total_over_bucket_collectives(mesh8):
    shapes = [(37,), (5, 20), (300,), (64,)]  # 501 float32 = 2004 bytes per device
    total = sum(math.prod(s) for s in shapes) * 4
    args = tuple(jnp.ones((8 * s[0],) + s[1:]) for s in shapes)

    def run(bucket_bytes, options=None):
        return compiled(mesh8, lambda *v: comm.bucketed_all_reduce(
            list(v), "x", bucket_bytes=bucket_bytes), *args, spec=P("x"), options=options)

    no_combiner = {"xla_disable_hlo_passes": "cpu-all-reduce-combiner"}
    for bucket in (256, 400, 1000, 4096):
        separate = run(bucket, no_combiner)
        assert hlo.count(separate, "all-reduce") == math.ceil(total / bucket)
        # with XLA's own combiner on, the buckets become operands of fewer instructions
        combined = run(bucket)
        assert sum(len(c.shapes) for c in combined) == math.ceil(total / bucket)
        assert hlo.total_bytes(combined, "all-reduce") == total
    assert hlo.count(run(0, no_combiner), "all-reduce") == len(shapes)   # fusion off


def test_bf16_compression_halves_the_ring_bytes(mesh8):
    """Measured on the ring's collective-permutes. bf16 travels as its 16-bit pattern (u16):
    the CPU backend's float normalisation widens a plain bf16 collective-permute to f32,
    checked below as a fact of this backend, like its f32 all-reduce for bf16 psum (so the
    xla path saves nothing on CPU)."""
    x = jnp.ones(8 * 4096)
    plain = compiled(mesh8, lambda v: comm.ring_all_reduce(v, "x"), x)
    half = compiled(mesh8, lambda v: comm.ring_all_reduce(v, "x", compression="bf16"), x)
    assert {c.dtype for c in half} == {"u16"} and {c.dtype for c in plain} == {"f32"}
    assert hlo.count(half) == hlo.count(plain) == 14
    assert 2 * hlo.total_bytes(half) == hlo.total_bytes(plain)
    tree = compiled(mesh8, lambda v: comm.tree_all_reduce(v, "x", compression="fp16"), x)
    assert hlo.total_bytes(tree) == 3 * 4096 * 2
    if jax.default_backend() == "cpu":
        xla = compiled(mesh8, lambda v: comm.all_reduce(v, "x", compression="bf16"), x)
        assert [c.dtype for c in xla] == ["f32"]
        raw = compiled(mesh8, lambda v: jax.lax.ppermute(
            v.astype(jnp.bfloat16), "x", [(i, (i + 1) % 8) for i in range(8)]), x)
        assert [c.dtype for c in raw] == ["f32"]


def test_quantized_all_reduce_sends_int8(mesh8):
    size, block = 8 * 256, 256
    found = compiled(mesh8, lambda v: comm.quantized_all_reduce(v, "x", block_size=block),
                     jnp.ones(8 * size))
    payload = [c for c in found if c.dtype == "s8"]
    assert sorted(c.kind for c in payload) == ["all-gather", "all-to-all"]
    scales = [c for c in found if c.dtype == "f32"]
    quantized = hlo.total_bytes(found)
    assert quantized == 2 * size + 2 * 4 * size // block      # int8 + a float32 per block
    assert sum(c.message_bytes for c in scales) == 2 * 4 * size // block


def test_reduce_scatter_wrapper_is_a_real_reduce_scatter(mesh8):
    found = compiled(mesh8, lambda v: comm.reduce_scatter(v, "x"), jnp.ones(64 * 8))
    assert [c.kind for c in found] == ["reduce-scatter"]


def test_auto_picks_tree_for_small_and_ring_for_large(mesh8):
    big = 2**22  # 16 MiB per device: past the nvlink-h100 crossover (about 12 MB at n=8)
    small = jax.ShapeDtypeStruct((8 * 16,), jnp.float32)
    large = jax.ShapeDtypeStruct((8 * big,), jnp.float32)
    link = comm.cost.preset("nvlink-h100")
    assert comm.cost.choose_algorithm(16 * 4, 8, link) == "tree"
    assert comm.cost.choose_algorithm(big * 4, 8, link) == "ring"
    found = compiled(mesh8, lambda a, b: comm.all_reduce(
        (a, b), "x", algorithm="auto", link=link), small, large)
    shapes = sorted(c.shapes[0][0] for c in found)
    assert shapes.count(16) == 3 and shapes.count(big // 8) == 14
