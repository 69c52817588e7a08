"""A report of predicted next to measured values: rows, ratios, flags; text, rich, dict.

Every :class:`Row` holds a predicted and a measured value (either may be missing), their
ratio ``measured / predicted``, and is *flagged* when they disagree by more than
``tolerance`` (10% by default), with the reason when it is known. A :class:`Report` prints
as a plain-text table (for logs), renders as a rich table in a terminal or a notebook, and
converts to a dict (for code and JSON).
"""

from __future__ import annotations

import dataclasses
import io
import math
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

TOLERANCE = 0.10


@dataclasses.dataclass(frozen=True)
class Row:
    """One quantity, predicted and measured.

    Attributes:
      section: the group it belongs to (``"memory per device"``, ``"collectives per step"``,
        ``"compute"``, ``"time"``).
      name: what it is (``"parameters"``, ``"all-reduce over data"``).
      predicted: the formula's value (None: no formula applies).
      measured: the compiled program's value (None: not measurable there).
      unit: ``"B"`` (bytes), ``"flop"``, ``"s"``, ``"fraction"``.
      how: the formula, or where the measurement comes from.
      reason: why the two may disagree, when known.
      tolerance: the relative disagreement above which the row is flagged.
    """

    section: str
    name: str
    predicted: float | None
    measured: float | None
    unit: str = "B"
    how: str = ""
    reason: str = ""
    tolerance: float = TOLERANCE

    @property
    def ratio(self) -> float | None:
        """``measured / predicted`` (None when either is missing or the prediction is 0)."""
        if self.predicted is None or self.measured is None:
            return None
        if self.predicted == 0:
            return 1.0 if self.measured == 0 else math.inf
        return self.measured / self.predicted

    @property
    def flagged(self) -> bool:
        """True when both values exist and differ by more than ``tolerance``."""
        r = self.ratio
        return r is not None and abs(r - 1) > self.tolerance

    def as_dict(self) -> dict:
        return dataclasses.asdict(self) | {"ratio": self.ratio, "flagged": self.flagged}


def _number(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "fraction":
        return f"{100 * value:.1f}%"
    if unit == "s":
        return f"{value * 1e3:.3g} ms" if value < 1 else f"{value:.3g} s"
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.4g} {unit}"


def _ratio(row: Row) -> str:
    r = row.ratio
    return "-" if r is None else ("inf" if math.isinf(r) else f"{r:.2f}")


@dataclasses.dataclass(frozen=True)
class Report:
    """A titled list of rows, with a few facts about what was measured.

    Example:
      >>> r = Report("demo", [Row("memory per device", "parameters", 100.0, 104.0),
      ...                     Row("memory per device", "activations", 100.0, 180.0,
      ...                         reason="fusion")])
      >>> [row.name for row in r.flagged()]
      ['activations']
      >>> print(r.text().splitlines()[0])
      demo
    """

    title: str
    rows: Sequence[Row]
    facts: dict = dataclasses.field(default_factory=dict)

    def row(self, name: str, section: str | None = None) -> Row:
        """The row called ``name`` (in ``section``, when given)."""
        for row in self.rows:
            if row.name == name and (section is None or row.section == section):
                return row
        raise KeyError(f"Report: no row {name!r}; the rows are "
                       f"{', '.join(r.name for r in self.rows)}.")

    def flagged(self) -> list[Row]:
        """The rows whose prediction and measurement disagree by more than their tolerance."""
        return [row for row in self.rows if row.flagged]

    def text(self) -> str:
        """A plain-text table, for logs."""
        head = ("quantity", "predicted", "measured", "ratio", "")
        body = [(r.name, _number(r.predicted, r.unit), _number(r.measured, r.unit), _ratio(r),
                 "!" if r.flagged else "") for r in self.rows]
        width = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
        lines = [self.title] + [f"  {k}: {v}" for k, v in self.facts.items()]
        section = None
        for row, cells in zip(self.rows, body):
            if row.section != section:
                section = row.section
                lines += ["", section, "  " + "  ".join(
                    h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(
                        zip(head, width)))]
            lines.append("  " + "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, width))))
        notes = [f"  ! {r.name}: {r.reason or 'no known reason'}" for r in self.flagged()]
        if notes:
            lines += ["", f"disagreements over {int(TOLERANCE * 100)}%:"] + notes
        return "\n".join(line.rstrip() for line in lines)

    def __str__(self) -> str:
        return self.text()

    def rich_table(self):
        """A ``rich.table.Table`` of the rows (for a terminal or a notebook)."""
        table = Table(title=self.title, caption="; ".join(f"{k}: {v}" for k, v in
                                                          self.facts.items()))
        for col, justify in (("section", "left"), ("quantity", "left"), ("predicted", "right"),
                             ("measured", "right"), ("ratio", "right"), ("how / why", "left")):
            table.add_column(col, justify=justify)
        for r in self.rows:
            style = "bold red" if r.flagged else None
            note = r.reason if r.flagged and r.reason else r.how
            table.add_row(r.section, r.name, _number(r.predicted, r.unit),
                          _number(r.measured, r.unit), _ratio(r), note, style=style)
        return table

    def print(self, console=None) -> None:
        """Prints a rich table when the output is a terminal or notebook, else :meth:`text`."""
        console = console or Console()
        if console.is_terminal or console.is_jupyter:
            console.print(self.rich_table())
        else:
            print(self.text())

    def _repr_html_(self) -> str:  # notebooks: the rich table as HTML
        console = Console(record=True, width=140, file=io.StringIO())
        console.print(self.rich_table())
        return console.export_html(inline_styles=True)

    def as_dict(self) -> dict:
        """``{"title", "facts", "rows": [...]}`` with each row's ratio and flag."""
        return {"title": self.title, "facts": dict(self.facts),
                "rows": [row.as_dict() for row in self.rows]}
