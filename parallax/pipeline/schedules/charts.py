"""Gantt charts of pipeline schedules: ASCII (:func:`text`) and matplotlib (:func:`plot`)."""

from __future__ import annotations

from parallax.pipeline.schedules.action import costs

COLORS = {"F": "#4c72b0", "B": "#55a868", "W": "#dd8452"}
LEGEND = "F forward, B input-gradient backward, W weight-gradient backward, . idle"


def text(schedule, *, f: float = 1, b: float = 1, w: float = 1) -> str:
    """An ASCII Gantt chart: one row per stage, one column per tick (``.`` is idle).

    The first line names the schedule, its sizes, its placement when it is not looped and
    its bubble under the costs; the last is the legend.

    Example:
      >>> from parallax.pipeline import schedule
      >>> print(text(schedule("1f1b", 2, 1)))
      1f1b: 2 stages, 1 micro-batches, fused backward; 6 ticks, bubble 50.0% (f=1, b=1, w=1)
      tick    0  1  2  3  4  5
      stage 0 F0 .  .  .  B0 W0
      stage 1 .  F0 B0 W0 .  .
      F forward, B input-gradient backward, W weight-gradient backward, . idle
    """
    labels = [[schedule.label(a) if a is not None else "." for a in row]
              for row in schedule.table]
    width = max([len(x) for row in labels for x in row]
                + [len(str(max(schedule.ticks - 1, 0)))])
    chunks = (f", {schedule.virtual_stages} chunks per stage"
              if schedule.virtual_stages > 1 else "")
    head = (
        f"{schedule.name}: {schedule.stages} stages, {schedule.microbatches} micro-batches"
        f"{chunks}{schedule.placement.label()}, "
        f"{'split' if schedule.split_backward else 'fused'} backward; {schedule.ticks} ticks, "
        f"bubble {100 * schedule.bubble_fraction(f, b, w):.1f}% "
        f"(f={f}, b={b}, w={w})"
    )
    name_width = len(f"stage {schedule.stages - 1}") + 1
    lines = [head, "tick".ljust(name_width)
             + " ".join(str(t).ljust(width) for t in range(schedule.ticks))]
    for s in range(schedule.stages):
        cells = " ".join(labels[t][s].ljust(width) for t in range(schedule.ticks))
        lines.append(f"stage {s}".ljust(name_width) + cells)
    lines.append(LEGEND)
    return "\n".join(line.rstrip() for line in lines)


def plot(
    schedule, path=None, *, f: float = 1, b: float = 1, w: float = 1, ax=None
):
    """Draws ``schedule`` as a Gantt chart in time units and optionally saves it.

    Each tick is as wide as its slowest action under the costs ``f``, ``b``, ``w`` (see
    :meth:`Schedule.time`); each action is as wide as its own cost, so the white space is
    the bubble a lock-step runtime pays, including waiting for a slower action in a tick.
    Later virtual stages are drawn lighter (so a V-shaped schedule shows its second chunk,
    the way back up, lighter), and the title names a placement that is not looped.

    Args:
      schedule: the :class:`Schedule`.
      path: where to save the figure (any format matplotlib knows); ``None`` to only return it.
      f, b, w: costs per action, as for :meth:`Schedule.time`.
      ax: a matplotlib ``Axes`` to draw on; a new figure when ``None``.

    Returns:
      The matplotlib ``Figure``.

    Raises:
      ImportError: if matplotlib is not installed.

    Example:
      >>> from parallax.pipeline import schedule
      >>> fig = schedule("1f1b", 4, 8).plot()          # doctest: +SKIP
      >>> schedule("1f1b", 4, 8).plot("1f1b.png")     # doctest: +SKIP
    """
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as error:
        raise ImportError(
            "Schedule.plot needs matplotlib, an optional dependency of parallax: "
            "pip install matplotlib (or pip install 'parallax[dev]')"
        ) from error
    cost = costs(f, b, w)
    if ax is None:
        fig = Figure(
            figsize=(min(max(6.0, 0.3 * schedule.ticks), 24.0), 1.2 + 0.45 * schedule.stages)
        )
        ax = fig.add_subplot()
    else:
        fig = ax.figure
    start = 0.0
    for row in schedule.table:
        for s, a in enumerate(row):
            if a is None:
                continue
            virtual = schedule.placement.virtual_stage(s, a.chunk)
            shade = 1.0 - 0.45 * (virtual // schedule.stages) / max(
                schedule.virtual_stages - 1, 1)
            ax.broken_barh(
                [(start, cost[a.kind])],
                (s - 0.4, 0.8),
                facecolors=COLORS[a.kind],
                alpha=shade,
                edgecolor="white",
            )
            if schedule.ticks <= 64:
                ax.text(
                    start + cost[a.kind] / 2,
                    s,
                    schedule.label(a),
                    ha="center",
                    va="center",
                    fontsize=7 if schedule.virtual_stages == 1 else 5,
                    color="white",
                )
        start += max((cost[a.kind] for a in row if a is not None), default=0)
    ax.set_xlim(0, start)
    ax.set_ylim(schedule.stages - 0.5, -0.5)
    ax.set_yticks(range(schedule.stages), [f"stage {s}" for s in range(schedule.stages)])
    ax.set_xlabel(f"time, lock-step (f={f}, b={b}, w={w})")
    ax.set_title(
        f"{schedule.name}: {schedule.stages} stages, {schedule.microbatches} micro-batches"
        f"{schedule.placement.label()}, lock-step bubble "
        f"{100 * schedule.bubble_fraction(f, b, w, lockstep=True):.1f}%"
    )
    names = {"F": "forward", "B": "input-gradient backward", "W": "weight-gradient backward"}
    ax.legend(
        handles=[Patch(color=COLORS[k], label=names[k]) for k in "FBW"],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=7,
        frameon=False,
    )
    if path is not None:
        fig.savefig(path, dpi=120, bbox_inches="tight")
    return fig
