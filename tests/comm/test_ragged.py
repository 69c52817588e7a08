"""parallax.comm.ragged: the emulated ragged all-to-all equals a numpy re-statement of
``jax.lax.ragged_all_to_all``'s documented semantics, on jax's own example and on random
ragged layouts (several slices per device, gaps, untouched output rows)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import parallax as px
from parallax.comm.ragged import emulated_ragged_all_to_all


def reference(operands, outputs, input_offsets, send_sizes, output_offsets):
    """jax's docstring, written out: device d's slice i goes to device i // (K / n), at
    ``output_offsets[d][i]`` there."""
    n, k = len(operands), len(input_offsets[0])
    per = k // n
    results = [np.array(o) for o in outputs]
    for src in range(n):
        for i in range(k):
            start, size, where = input_offsets[src][i], send_sizes[src][i], output_offsets[src][i]
            results[i // per][where:where + size] = operands[src][start:start + size]
    return results


def run(n, operands, outputs, input_offsets, send_sizes, output_offsets, recv_sizes):
    mesh = px.make_mesh(expert=n, devices=jax.devices()[:n])
    f = jax.shard_map(lambda *a: emulated_ragged_all_to_all(*a, axis_name="expert"), mesh=mesh,
                      in_specs=jax.P("expert"), out_specs=jax.P("expert"))
    joined = [jnp.asarray(np.concatenate(a)) for a in (operands, outputs, input_offsets,
                                                        send_sizes, output_offsets, recv_sizes)]
    return np.split(np.asarray(jax.jit(f)(*joined)), n)


def test_jax_docstring_example():
    args = ([[1, 2, 2], [3, 4, 0]], [[0] * 4, [0] * 4], [[0, 1], [0, 1]], [[1, 2], [1, 1]],
            [[0, 0], [1, 2]], [[1, 1], [2, 1]])
    got = run(2, *[[np.array(a, np.int32) for a in arg] for arg in args])
    assert [g.tolist() for g in got] == [[1, 3, 0, 0], [2, 2, 4, 0]]


def random_layout(rng, n, per, rows, out_rows):
    """Each device sends ``per`` slices to each device, packed at random offsets on both sides."""
    k = n * per
    sizes = rng.integers(0, 3, (n, k))  # sizes[src, i]: to device i // per
    input_offsets = np.zeros((n, k), np.int32)
    for src in range(n):  # slices in a shuffled order with gaps between them
        at = 0
        for i in rng.permutation(k):
            at += int(rng.integers(0, 2))
            input_offsets[src, i] = at
            at += sizes[src, i]
        assert at <= rows
    output_offsets, recv_sizes = np.zeros((n, k), np.int32), np.zeros((n, k), np.int32)
    for dst in range(n):
        at = 1  # row 0 of every output is never written
        for src in rng.permutation(n):
            for j in range(per):
                i = dst * per + j
                output_offsets[src, i] = at
                recv_sizes[dst, src * per + j] = sizes[src, i]
                at += sizes[src, i]
        assert at <= out_rows
    operands = [rng.standard_normal((rows, 3)).astype(np.float32) for _ in range(n)]
    outputs = [np.full((out_rows, 3), -7.0, np.float32) for _ in range(n)]
    return (operands, outputs, list(input_offsets), list(sizes.astype(np.int32)),
            list(output_offsets), list(recv_sizes))


@pytest.mark.parametrize("n, per", [(4, 1), (4, 2), (8, 1)])
def test_random_layouts_equal_the_reference(n, per):
    rng = np.random.default_rng(n * 10 + per)
    for _ in range(3):
        args = random_layout(rng, n, per, rows=40, out_rows=60)
        got = run(n, *args)
        want = reference(*args[:5])
        assert all(np.array_equal(g, w) for g, w in zip(got, want))
