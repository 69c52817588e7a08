"""Pipeline schedules as data: a validated table of ticks x stages, costed before anything runs.

The tick model (an SPMD lock-step runtime, see ``docs/pipeline.md``):

* All stages advance through ticks together. In a tick every stage runs at most one action
  (or idles), then every stage exchanges activations and gradients with its neighbours
  (``ppermute``). A tick therefore lasts as long as its slowest action, on every stage.
* An action is ``F`` (forward), ``B`` (input-gradient backward: the gradient the previous
  stage waits for) or ``W`` (weight-gradient backward) of one micro-batch on one model chunk.
  Every backward is two actions, ``B`` then ``W``: an SPMD runtime can spend two ticks on a
  backward only by computing a different part of it in each, and these two parts are the
  ones that matter (``B`` is on the critical path, ``W`` is not).
* ``split_backward=False`` schedules the two halves as one unit, as the published classic
  schedules do: ``W`` runs in the tick right after its ``B``, and the previous stage starts
  its backward only after that ``W``. With equal costs ``f = b = w = 1`` (the times of one
  ``F``, ``B``, ``W``: the zero-bubble paper's ``T_F``, ``T_B``, ``T_W``) every tick costs 1,
  and GPipe, 1F1B and interleaved 1F1B have exactly their published bubble fractions.
  ``split_backward=True`` lets the previous stage start after ``B`` (the zero-bubble
  schedules), which shortens the critical path.
* A value sent at the end of tick ``t`` is usable from tick ``t + 1``.
* Which virtual stage each (stage, chunk) runs is the schedule's :class:`Placement`:
  looped (Megatron) or V-shaped (ZB-V, DualPipeV).

Modules: ``action`` (one cell), ``placement``, ``dependencies`` (which actions must run
before which, validation and as-early-as-possible placement of orders), ``table``
(:class:`Schedule`), ``timeline`` (the papers' asynchronous replay and bubble), ``slots`` (the arrays and buffer plan a runtime reads), ``named`` and
``zero_bubble`` (the named schedules), ``charts`` (ASCII and matplotlib Gantt charts).
"""

from parallax.pipeline.schedules.action import Action as Action
from parallax.pipeline.schedules.named import SCHEDULES as SCHEDULES
from parallax.pipeline.schedules.named import schedule as schedule
from parallax.pipeline.schedules.placement import Placement as Placement
from parallax.pipeline.schedules.table import Schedule as Schedule

__all__ = ["SCHEDULES", "Action", "Placement", "Schedule", "schedule"]
