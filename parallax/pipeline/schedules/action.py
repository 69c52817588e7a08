"""One action of a pipeline schedule, and its string form ("F3", "B3.1")."""

from __future__ import annotations

import numbers
import re
from typing import NamedTuple

KINDS = ("F", "B", "W")
# Codes of ``Schedule.as_arrays().kind``; 0 is idle.
KIND_CODES = {"F": 1, "B": 2, "W": 3}
_ACTION = re.compile(r"^([FBW])(\d+)(?:\.(\d+))?$")
_IDLE = (None, "", ".", "-")


class Action(NamedTuple):
    """One action of a schedule: ``kind`` of ``microbatch`` on model ``chunk``.

    Written ``"F3"`` (forward of micro-batch 3) or ``"B3.1"`` (input-gradient backward of
    micro-batch 3 on chunk 1, for interleaved schedules).
    """

    kind: str  # "F", "B" or "W"
    microbatch: int
    chunk: int = 0

    def label(self, chunk: bool | None = None) -> str:
        """The string form; ``chunk=None`` writes the chunk only when it is not 0."""
        show = self.chunk != 0 if chunk is None else chunk
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if show else "")

    def __str__(self) -> str:
        return self.label()

    @classmethod
    def parse(cls, text: str) -> Action:
        """Reads ``"F3"``, ``"B3.1"``, ``"W0"``."""
        match = _ACTION.match(text.strip()) if isinstance(text, str) else None
        if match is None:
            raise ValueError(
                f"schedule: cannot read {text!r} as an action; write a kind (F, B or W), a "
                "micro-batch and optionally '.chunk', e.g. 'F3' or 'B3.1' ('.' is idle)"
            )
        return cls(match[1], int(match[2]), int(match[3] or 0))


def parse_cell(cell) -> Action | None:
    """A table cell as an action, or ``None`` for idle (``None``, ``""``, ``"."``, ``"-"``)."""
    if isinstance(cell, Action):
        return cell
    if cell in _IDLE:
        return None
    if isinstance(cell, str):
        return Action.parse(cell)
    raise TypeError(f"schedule: a cell must be an Action, a string like 'F3' or None, got {cell!r}")


def parse_order(order, stage: int) -> list[Action]:
    """One stage's order (a string or a list of cells) as actions.

    An order without any ``W`` gets one right after each ``B``.
    """
    cells = order.split() if isinstance(order, str) else list(order)
    actions = [parse_cell(cell) for cell in cells]
    if any(a is None for a in actions):
        raise ValueError(
            f"schedule: the order of stage {stage} holds an idle cell; orders list actions only"
        )
    if not any(a.kind == "W" for a in actions):
        actions = [
            x
            for a in actions
            for x in ((a, Action("W", a.microbatch, a.chunk)) if a.kind == "B" else (a,))
        ]
    return actions


def sizes(actions: list[list[Action]], microbatches, virtual_stages) -> tuple[int, int]:
    """Micro-batches and chunks: the given ones, or the largest named plus one."""
    flat = [a for row in actions for a in row]
    if microbatches is None:
        microbatches = max((a.microbatch for a in flat), default=-1) + 1
    if virtual_stages is None:
        virtual_stages = max((a.chunk for a in flat), default=0) + 1
    return microbatches, virtual_stages


def costs(f, b, w) -> dict[str, float]:
    """The time of each action kind: ``F`` costs ``f``, ``B`` costs ``b``, ``W`` costs ``w``.

    These are the zero-bubble paper's ``T_F``, ``T_B`` (input gradient only) and ``T_W``, so
    a whole backward costs ``b + w`` and ``f = b = w = 1`` is the papers' "equal F, B, W".
    """
    for name, value in (("f", f), ("b", b)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
            raise ValueError(f"schedule: cost {name} must be a positive number, got {value!r}")
    if isinstance(w, bool) or not isinstance(w, numbers.Real) or not w >= 0:
        raise ValueError(
            f"schedule: cost w (the weight-gradient part of a backward, T_W) must be a number "
            f">= 0, got {w!r}; f, b and w are the times of one F, one B and one W"
        )
    return {"F": f, "B": b, "W": w}
