"""How often the pipeline runtime's guarded loops run and its conditionals take each branch,
from its plan: the ``fractions`` that :func:`parallax.analysis.executed.executed_cost` weighs
a compiled pipelined step's loops and branches by.

The runtime knows its plan; the reader of compiled programs (:mod:`parallax.analysis`) knows
only op names. This module joins the two, so the reader never imports the pipeline.

Example:
  >>> from parallax.pipeline import schedule
  >>> from parallax.pipeline.runtime.lowering import lower_schedule
  >>> fractions = table_fractions(lower_schedule(schedule("1f1b", 2, 4), "never"))
  >>> [round(share, 3) for share in fractions("tick/pp_F/while", 0)]  # forwards' guard
  [0.267]
"""

from __future__ import annotations

from parallax.analysis.executed import Fractions
from parallax.analysis.program import pipeline_shares
from parallax.pipeline.runtime.lowering import RUNTIME_CODES


def table_fractions(lowered) -> Fractions:
    """How often the runtime's guarded loops run and its conditionals take each branch, from
    its :class:`~parallax.pipeline.runtime.lowering.LoweredSchedule`.

    The guard of each kind of action (``pp_F``, ``pp_B``, ``pp_W``, ``pp_BW``: a ``while``
    of 0 or 1 trips) runs as often as the table has cells of that kind; a flag's ``lax.cond``
    or guard inside one (``pp_first``, ``pp_last``, ``pp_remat``) as often as the cells of
    that kind carry the flag. Any other conditional counts as its most expensive branch,
    any other loop of unknown trip count once.
    """
    kind = lowered.kind

    def action_share(name: str) -> float:
        return float((kind == RUNTIME_CODES[name]).mean())

    def flag_share(name: str, flag: str) -> float | None:
        among = kind == RUNTIME_CODES[name]
        return float(getattr(lowered, flag)[among].mean()) if among.any() else None

    def fractions(op_name: str, branches: int) -> list[float] | None:
        return pipeline_shares(op_name, branches, action_share, flag_share)

    return fractions
