"""Which stored layers every chunk runs (looped, V, uneven), moved there and back."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parallax.pipeline import Placement
from parallax.pipeline.runtime.layer_moves import Layout, from_chunks, to_chunks

from ..runtime_testing import stage_mesh

LAYOUTS = [
    Layout.even(8, Placement.looped(4)),
    Layout.even(8, Placement.looped(2, 2)),
    Layout.even(12, Placement.looped(2, 3)),
    Layout.even(16, Placement.looped(4, 2)),
    Layout.even(8, Placement.v(2)),
    Layout.even(16, Placement.v(4)),
    Layout.balanced((3, 2, 2, 1), Placement.looped(4)),
    Layout.balanced((2, 1, 3, 2), Placement.v(2)),
    Layout.balanced((1, 1, 1, 3), Placement.looped(2, 2)),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: f"{lay.placement.name}-"
                         f"{lay.placement.stages}x{lay.placement.chunks}-{lay.boundaries}")
def test_every_layer_reaches_the_slot_that_runs_it_and_its_gradient_comes_back(layout):
    S = layout.placement.stages
    stack = jnp.arange(layout.layers * 2.0).reshape(layout.layers, 2)  # layer i: [2i, 2i+1]

    def round_trip(local):
        chunks = to_chunks(local, "stage", layout)
        return chunks[None], from_chunks(chunks, "stage", layout)

    with jax.set_mesh(stage_mesh(S)):
        chunks, back = jax.jit(jax.shard_map(
            round_trip, in_specs=jax.P("stage"),
            out_specs=(jax.P("stage"), jax.P("stage"))))(stack)
    for s in range(S):
        for c in range(layout.placement.chunks):
            for j, layer in enumerate(layout.runs(s, c)):
                want = np.zeros(2) if layer is None else stack[layer]  # masked slots: zeros
                np.testing.assert_array_equal(chunks[s, c, j], want)
    np.testing.assert_array_equal(back, stack)
    assert (layout.mask is None) == (layout.padding == 0)


def test_an_even_single_chunk_layout_moves_nothing():
    assert Layout.even(8, Placement.looped(4)).in_place
    assert not Layout.even(8, Placement.v(2)).in_place


def test_uneven_layouts_pad_every_chunk_to_the_largest():
    layout = Layout.balanced((3, 2, 2, 1), Placement.looped(4))
    assert (layout.slots, layout.padding) == (3, 4)
    assert layout.mask.tolist() == [[[True, True, True]], [[True, True, False]],
                                    [[True, True, False]], [[True, False, False]]]
