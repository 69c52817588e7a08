"""Gantt charts of pipeline schedules (matplotlib, an optional dependency)."""

from __future__ import annotations

from parallax.pipeline.action import costs

COLORS = {"F": "#4c72b0", "B": "#55a868", "W": "#dd8452"}


def plot(
    schedule, path=None, *, f: float = 1, b: float = 2, w: float | None = None, ax=None
):
    """Draws ``schedule`` as a Gantt chart in time units and optionally saves it.

    Each tick is as wide as its slowest action under the costs ``f``, ``b``, ``w`` (see
    :meth:`Schedule.time`); each action is as wide as its own cost, so the white space is
    the bubble a lock-step runtime pays, including waiting for a slower action in a tick.
    Later chunks of interleaved schedules are drawn lighter.

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
            shade = 1.0 - 0.45 * a.chunk / max(schedule.virtual_stages - 1, 1)
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
    ax.set_xlabel(f"time (f={f}, b={b}, w={b / 2 if w is None else w})")
    ax.set_title(
        f"{schedule.name}: {schedule.stages} stages, {schedule.microbatches} micro-batches, "
        f"bubble {100 * schedule.bubble_fraction(f, b, w):.1f}%"
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
