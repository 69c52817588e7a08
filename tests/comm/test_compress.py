"""bf16/fp16 on the wire, and the int8 quantised all-reduce with its error bound."""

import jax.numpy as jnp
import numpy as np
import pytest

from .comm_testing import grid_mesh, line_mesh, per_device, stacked
from parallax import comm
from parallax.comm import Compression


@pytest.mark.parametrize("outer,inner", [(1, 2), (2, 2), (2, 4)])
def test_16_bit_wire_errors_are_bounded_and_results_replicated(outer, inner):
    """Every compressed path on n = outer * inner devices: all_reduce, bucketed (3 buckets),
    ring_reduce_scatter (13 rows padded to n * ceil(13/n)) and hierarchical on an outer x
    inner mesh. The last three run bf16 on the float32 leaf only (each leaf is a compile;
    all_reduce checks fp16, which differs only in the wire dtype, and that integers are
    never cast)."""
    n = outer * inner
    x = stacked(n, shapes=[(13,)], dtypes=[jnp.float32, jnp.int32])
    algorithms = ("xla", "ring", "tree")

    def flat(v):
        out = {f"{a}/{c.name}": comm.all_reduce(v, "x", algorithm=a, compression=c)
               for a in algorithms for c in (Compression.bf16, Compression.fp16)}
        f32 = {"float32_13": v["float32_13"]}
        # ring buckets with bf16 are in test_bucket.py; the packing ignores the algorithm
        out["bucketed/bf16"] = comm.bucketed_all_reduce(f32, "x", bucket_bytes=24,
                                                        compression="bf16")
        out["rs/bf16"] = comm.ring_reduce_scatter(f32, "x", compression="bf16")
        return out

    out = per_device(line_mesh(n), flat, x)
    out.update(per_device(grid_mesh(outer, inner), lambda v: {
        f"hier-{a}/bf16": comm.hierarchical_all_reduce(v, "tensor", "data", algorithm=a,
                                                       compression="bf16")
        for a in ("xla", "ring")}, {"float32_13": x["float32_13"]}, axis=("data", "tensor")))
    c = -(-13 // n)
    for name, tree in out.items():
        a, comp = name.split("/")
        eps = 2.0**-8 if comp == "bf16" else 2.0**-11
        for key in tree:
            v = x[key]
            got, ref = np.asarray(tree[key], np.float64), np.asarray(v, np.float64)
            want, scale = ref.sum(0), np.abs(ref).sum(0)
            assert tree[key].dtype == v.dtype
            if a == "rs":                                   # device i: block i of the sum
                want, scale = (np.pad(t, (0, n * c - 13)).reshape(n, c) for t in (want, scale))
            else:
                assert np.all(got == got[:1]), (a, comp, key)   # identical on every device
                got = got[0]
            if v.dtype == jnp.int32:                            # integers are never cast
                np.testing.assert_array_equal(got, want, err_msg=name)
                continue
            # each of the <= n + log2(n) roundings errs by <= eps * the partial sum's size
            assert np.all(np.abs(got - want) <= 2 * n * eps * scale), (a, comp, key)


def test_compression_names_and_dtypes():
    assert comm.Compression("bf16") is Compression.bf16
    assert Compression.bf16.wire_dtype(jnp.float32) == jnp.bfloat16
    assert Compression.fp16.wire_dtype(jnp.bfloat16) == jnp.bfloat16   # never widen
    assert Compression.bf16.wire_dtype(jnp.int32) == jnp.int32
    assert Compression.bf16.accumulate_dtype(jnp.bfloat16) == jnp.float32


@pytest.mark.parametrize("n", [2, 4, 8])
def test_quantized_all_reduce_within_bound(n):
    rng = np.random.default_rng(n)
    x = {
        "odd": jnp.asarray(rng.standard_normal((n, 37)), jnp.float32),
        "scaled": jnp.asarray(rng.standard_normal((n, 3, 50)) * 10.0 ** rng.integers(
            -3, 3, (n, 3, 50)), jnp.float32),
        "bf16": jnp.asarray(rng.standard_normal((n, 9)), jnp.bfloat16),
    }
    out = per_device(line_mesh(n), lambda v: {
        "sum": comm.quantized_all_reduce(v, "x", block_size=16),
        "mean": comm.quantized_all_reduce(v, "x", op="mean", block_size=16)}, x)
    for key, v in x.items():
        ref = np.asarray(v, np.float64)
        got = np.asarray(out["sum"][key], np.float64)
        assert np.all(got == got[:1]), key
        bound = comm.quantized_error_bound(ref, block_size=16)
        if v.dtype == jnp.bfloat16:
            bound = bound + 2.0**-8 * np.abs(ref.sum(0))        # the final cast to bf16
        assert np.all(np.abs(got[0] - ref.sum(0)) <= bound), key
        np.testing.assert_allclose(np.asarray(out["mean"][key], np.float64)[0] * n, got[0],
                                   rtol=1e-2 if v.dtype == jnp.bfloat16 else 1e-6)
    # on well-scaled data the error is far below the bound's worst case
    err = np.abs(np.asarray(out["sum"]["odd"])[0] - np.asarray(x["odd"]).sum(0))
    assert err.max() < 0.05 * np.abs(np.asarray(x["odd"])).max() * n


def test_quantize_roundtrip_bound():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 64)), jnp.float32)
    q, s = comm.quantize_int8(x, block_size=16)
    assert q.dtype == jnp.int8 and s.shape == (4, 4)
    err = np.abs(np.asarray(comm.dequantize_int8(q, s, 16)) - np.asarray(x))
    assert np.all(err <= np.repeat(np.asarray(s), 16, axis=1) / 2 + 1e-7)
