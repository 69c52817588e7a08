"""Which stored layers each chunk runs, and moving them there (and their gradients back).

The stacked parameters ``[L, ...]`` are stored contiguously over the stage axis (rule
``("layers", "stage")``): stage ``s`` holds layers ``s L / S .. (s + 1) L / S - 1``. A
:class:`Layout` says which layers every (stage, chunk) *runs*: virtual stage ``k`` runs
``boundaries[k] .. boundaries[k + 1] - 1`` (in the sequential order), and the placement says
where virtual stage ``k`` is. Even layouts give every virtual stage ``L / (S v)`` layers;
uneven ones (a partition from ``px.pipeline.partition``, torchgpipe's ``balance``) give
each as many as the partition says, and pad every chunk to the largest count with *masked*
slots: a slot without a layer holds zeros and is skipped (``lax.cond``: it computes nothing
and passes its input through), since an SPMD program has one shape on every stage.

:func:`to_chunks` moves every layer to the slot that runs it with ``ppermute`` (contiguous
runs of layers that go the same way move as one slice; layers already in place do not
cross the stage axis; an even looped layout with one chunk is a reshape); :func:`from_chunks`
sends the gradients back the same way. GSPMD, asked for the interleaved reshard as a
reshape of ``[L]`` into ``[v, S, L_c]``, moved the local stack twice each way (an all-to-all
and a collective-permute, measured).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
from jax import lax

from parallax.pipeline.schedules.placement import Placement


@dataclasses.dataclass(frozen=True)
class Layout:
    """The layers each virtual stage runs, placed on the stages.

    Attributes:
      placement: where each virtual stage runs.
      layers: ``L``, the stacked layers.
      boundaries: ``placement.count + 1`` indices: virtual stage ``k`` runs layers
        ``boundaries[k] .. boundaries[k + 1] - 1``.

    Example:
      >>> layout = Layout.balanced((3, 2, 2, 1), Placement.looped(4))
      >>> layout.slots, layout.padding
      (3, 4)
      >>> layout.runs(1, 0)            # stage 1, chunk 0: layers 3 and 4, then a masked slot
      (3, 4, None)
    """

    placement: Placement
    layers: int
    boundaries: tuple[int, ...]

    @classmethod
    def even(cls, layers: int, placement: Placement) -> Layout:
        """``L / (S v)`` layers per virtual stage (the caller checks divisibility)."""
        per = layers // placement.count
        return cls(placement, layers, tuple(k * per for k in range(placement.count + 1)))

    @classmethod
    def balanced(cls, balance: Sequence[int], placement: Placement) -> Layout:
        """Layer counts per virtual stage (torchgpipe's ``balance``), in virtual-stage order."""
        balance = tuple(int(n) for n in balance)
        return cls(placement, sum(balance), tuple(np.cumsum((0,) + balance).tolist()))

    @property
    def slots(self) -> int:
        """Layer slots per chunk: the largest virtual stage."""
        return max(b - a for a, b in zip(self.boundaries, self.boundaries[1:]))

    @property
    def padding(self) -> int:
        """Masked slots in all: ``S v slots - L``."""
        return self.placement.count * self.slots - self.layers

    def runs(self, stage: int, chunk: int) -> tuple[int | None, ...]:
        """The stored layer each slot of (stage, chunk) runs; ``None`` for a masked slot."""
        k = self.placement.virtual_stage(stage, chunk)
        first, last = self.boundaries[k], self.boundaries[k + 1]
        return tuple(first + j if first + j < last else None for j in range(self.slots))

    @functools.cached_property
    def mask(self) -> np.ndarray | None:
        """``[S, v, slots]`` bools, which slots hold a layer; ``None`` when none is padded."""
        if not self.padding:
            return None
        S, v = self.placement.stages, self.placement.chunks
        return np.array([[[j is not None for j in self.runs(s, c)] for c in range(v)]
                         for s in range(S)])

    @functools.cached_property
    def moves(self) -> tuple[tuple[int, int, int, int, tuple[tuple[int, int], ...]], ...]:
        """``(local, chunk, slot, count, pairs)``: stored layers ``local .. local + count - 1``
        of each ``src`` go to slots ``slot ..`` of ``chunk`` on ``dst``, for ``(src, dst)``."""
        S, v = self.placement.stages, self.placement.chunks
        per = self.layers // S
        route: dict[tuple[int, int, int], list[tuple[int, int]]] = {}
        for dst in range(S):
            for c in range(v):
                for j, layer in enumerate(self.runs(dst, c)):
                    if layer is not None:
                        route.setdefault((layer % per, c, j), []).append((layer // per, dst))
        moves: list = []
        for (i, c, j), pairs in sorted(route.items(), key=lambda kv: (kv[0][1], kv[0][2])):
            pairs = tuple(sorted(pairs))
            if moves:
                li, lc, lj, n, lpairs = moves[-1]
                if (lc, lpairs) == (c, pairs) and (li + n, lj + n) == (i, j):
                    moves[-1] = (li, lc, lj, n + 1, lpairs)
                    continue
            moves.append((i, c, j, 1, pairs))
        return tuple(moves)

    @property
    def in_place(self) -> bool:
        """Every stage runs exactly its stored layers, in order, in one chunk."""
        S = self.placement.stages
        return (self.placement.chunks == 1 and not self.padding
                and all(pairs == tuple((s, s) for s in range(S))
                        for _, _, _, _, pairs in self.moves))


def check_layers(layers: int, stages: int, virtual_stages: int, api: str,
                 axis: str = "stage") -> None:
    """An even layout needs the stack to split into ``stages * virtual_stages`` equal chunks."""
    chunks = stages * virtual_stages
    if layers % chunks:
        lower = layers - layers % chunks
        examples = f"{lower} or {lower + chunks}" if lower else f"{chunks}"
        raise ValueError(
            f"{api}: the model's {layers} stacked layers do not split into stages={stages} "
            f"(mesh axis {axis!r}) x virtual_stages={virtual_stages} = {chunks} equal chunks; "
            f"use a multiple of {chunks} layers (e.g. {examples}), stages and "
            f"virtual_stages whose product divides {layers}, or balance= to give each stage "
            "its own number of layers"
        )


def to_chunks(local, axis: str, layout: Layout):
    """A stage's stored layers ``[L / S, ...]`` -> the slots it runs ``[v, slots, ...]``."""
    v, n = layout.placement.chunks, layout.slots
    if layout.in_place:
        return local[None]
    chunks = [[None] * n for _ in range(v)]
    for i, c, j, count, pairs in layout.moves:
        block = local[i: i + count]
        if any(src != dst for src, dst in pairs):
            block = lax.ppermute(block, axis, pairs)
        elif len(pairs) < layout.placement.stages:  # in place on some stages, zeros elsewhere
            block = jnp.where(_on(axis, [d for _, d in pairs]), block, 0)
        for k in range(count):  # other moves fill this slot on other stages: add
            old = chunks[c][j + k]
            chunks[c][j + k] = block[k] if old is None else old + block[k]
    zero = jnp.zeros_like(local[0])
    return jnp.stack([jnp.stack([x if x is not None else zero for x in row]) for row in chunks])


def from_chunks(chunks, axis: str, layout: Layout):
    """The inverse of :func:`to_chunks`: gradients ``[v, slots, ...]`` -> ``[L / S, ...]``.

    Masked slots' gradients are dropped; every stored layer receives exactly one slot's.
    """
    if layout.in_place:
        return chunks[0]
    per = layout.layers // layout.placement.stages
    stored = [None] * per
    for i, c, j, count, pairs in layout.moves:
        block = chunks[c, j: j + count]
        if any(src != dst for src, dst in pairs):
            block = lax.ppermute(block, axis, tuple((d, s) for s, d in pairs))
        elif len(pairs) < layout.placement.stages:
            block = jnp.where(_on(axis, [s for s, _ in pairs]), block, 0)
        for k in range(count):
            stored[i + k] = block[k] if stored[i + k] is None else stored[i + k] + block[k]
    return jnp.stack(stored)


def _on(axis: str, stages: list[int]):
    """True on the listed stages (inside ``shard_map`` over ``axis``)."""
    index = lax.axis_index(axis)
    return functools.reduce(jnp.logical_or, [index == s for s in stages])

