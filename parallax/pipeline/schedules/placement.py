"""Which virtual stage each (stage, chunk) holds: the layout of the model over the stages.

A model cut into ``stages x chunks`` consecutive pieces (virtual stages ``0 .. V - 1``) is
placed on the stages in one of two published ways:

* **looped** (Megatron's interleaved schedule, PyTorch's ``"loop"`` style): chunk ``c`` of
  stage ``s`` is virtual stage ``c * stages + s``. Activations always travel to the next
  stage (the last stage's chunk ``c`` feeds stage 0's chunk ``c + 1``), gradients to the
  previous one.
* **V-shaped** (the zero-bubble paper's ZB-V, DeepSeek's DualPipeV, PyTorch's ``"v"``
  style), two chunks: stage ``s`` holds virtual stages ``s`` and ``2 stages - 1 - s``. The
  activations go down the stages and come back up; the turn (virtual stages ``S - 1`` and
  ``S``) stays on the last stage, and the first and last virtual stages both live on
  stage 0.

A placement is data (a tuple of tuples), validated once; the dependency rules, the buffer
plan, the runtime, the stacked-layer mover and the plots all read it.
"""

from __future__ import annotations

import dataclasses
import functools

PLACEMENTS = ("looped", "v")


@dataclasses.dataclass(frozen=True)
class Placement:
    """``virtual[s][c]``: the virtual stage that chunk ``c`` of stage ``s`` runs.

    Args:
      name: ``"looped"``, ``"v"`` or ``"custom"``.
      virtual: one row per stage, one virtual stage per chunk; together a permutation of
        ``0 .. stages * chunks - 1``, consecutive virtual stages on the same or
        neighbouring stages (the runtime sends only to its two neighbours).

    Raises:
      ValueError: if ``virtual`` is not such a permutation.

    Example:
      >>> Placement.v(4).virtual
      ((0, 7), (1, 6), (2, 5), (3, 4))
      >>> Placement.looped(2, 2).location(3), Placement.v(2).location(3)
      ((1, 1), (0, 1))

    References:
      Narayanan et al. 2021 (SC), Megatron-LM (interleaved, looped placement); Qi et al.
      2024, Zero Bubble Pipeline Parallelism, section 6 (ZB-V); DeepSeek-AI 2024,
      DeepSeek-V3 Technical Report (DualPipe; PyTorch's DualPipeV).
    """

    name: str
    virtual: tuple[tuple[int, ...], ...]

    def __post_init__(self):
        rows = tuple(tuple(int(k) for k in row) for row in self.virtual)
        object.__setattr__(self, "virtual", rows)
        if not rows or len({len(row) for row in rows}) != 1 or not rows[0]:
            raise ValueError(
                f"placement: every stage must hold the same number (>= 1) of chunks, got "
                f"{[len(row) for row in rows]}"
            )
        flat = sorted(k for row in rows for k in row)
        if flat != list(range(len(flat))):
            raise ValueError(
                f"placement: the virtual stages {rows} must be a permutation of 0..{len(flat) - 1}"
            )
        for k in range(len(flat) - 1):
            (a, _), (b, _) = self.location(k), self.location(k + 1)
            if len(rows) > 2 and b not in (a, (a + 1) % len(rows), (a - 1) % len(rows)):
                raise ValueError(
                    f"placement: virtual stages {k} and {k + 1} are on stages {a} and {b}, "
                    "which are not neighbours; the runtime sends activations and gradients "
                    "only to the next and previous stage"
                )

    @classmethod
    def looped(cls, stages: int, chunks: int = 1) -> Placement:
        """Megatron's layout: chunk ``c`` of stage ``s`` is virtual stage ``c * stages + s``."""
        return cls("looped", tuple(tuple(c * stages + s for c in range(chunks))
                                   for s in range(stages)))

    @classmethod
    def v(cls, stages: int) -> Placement:
        """The V layout: stage ``s`` holds virtual stages ``s`` and ``2 stages - 1 - s``."""
        return cls("v", tuple((s, 2 * stages - 1 - s) for s in range(stages)))

    @classmethod
    def named(cls, name: str, stages: int, chunks: int) -> Placement:
        """``"looped"`` or ``"v"`` (two chunks) for ``stages`` stages."""
        if name == "looped":
            return cls.looped(stages, chunks)
        if name == "v":
            if chunks != 2:
                raise ValueError(
                    f"placement: the V placement holds 2 chunks per stage, got virtual_stages="
                    f"{chunks}"
                )
            return cls.v(stages)
        raise ValueError(f"placement: unknown placement {name!r}; known: {', '.join(PLACEMENTS)}")

    @property
    def stages(self) -> int:
        return len(self.virtual)

    @property
    def chunks(self) -> int:
        return len(self.virtual[0])

    @property
    def count(self) -> int:
        """The number of virtual stages, ``stages * chunks``."""
        return self.stages * self.chunks

    def virtual_stage(self, stage: int, chunk: int) -> int:
        return self.virtual[stage][chunk]

    def location(self, virtual: int) -> tuple[int, int]:
        """``(stage, chunk)`` of a virtual stage."""
        return self._locations[virtual]

    @functools.cached_property
    def _locations(self) -> dict[int, tuple[int, int]]:
        return {k: (s, c) for s, row in enumerate(self.virtual) for c, k in enumerate(row)}

    def direction(self, virtual: int, to: int) -> str:
        """How a value goes from virtual stage ``virtual`` to ``to`` (one apart).

        ``"local"`` (same stage), ``"up"`` (to stage ``s + 1``, cyclically) or ``"down"``
        (to ``s - 1``). With two stages both neighbours are the same stage: ``"up"``.
        """
        a, b = self.location(virtual)[0], self.location(to)[0]
        if a == b:
            return "local"
        return "up" if b == (a + 1) % self.stages else "down"

    def label(self) -> str:
        """How charts name it: ``""`` when looped, else ``", V-shaped placement"``."""
        return {"looped": "", "v": ", V-shaped placement"}.get(self.name, ", custom placement")
