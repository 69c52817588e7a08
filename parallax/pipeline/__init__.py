"""Pipeline parallelism, the pure-Python half: schedules as data, partitioning, profiling.

A schedule is a validated table (tick x stage -> action) that a lock-step SPMD runtime reads
directly; it is printed, plotted and costed before anything runs:

    s = px.pipeline.schedule("1f1b", stages=4, microbatches=8)
    print(s.text())
    s.bubble_fraction(f=1, b=2)        # what the lock-step runtime really pays
    s.as_arrays()                      # int arrays [ticks, stages] and the buffer plan

    records = px.pipeline.profile(layers, sample)
    plan = px.pipeline.partition(records, stages=4, method="pipedream", bandwidth=1e10)

See ``docs/pipeline.md`` for the tick model and the formulas.
"""

from parallax.pipeline.partition import METHODS as METHODS
from parallax.pipeline.partition import Plan as Plan
from parallax.pipeline.partition import partition as partition
from parallax.pipeline.profile import LayerProfile as LayerProfile
from parallax.pipeline.profile import profile as profile
from parallax.pipeline.schedule import Action as Action
from parallax.pipeline.schedule import Schedule as Schedule
from parallax.pipeline.schedules import SCHEDULES as SCHEDULES
from parallax.pipeline.schedules import schedule as schedule

__all__ = [
    "METHODS",
    "SCHEDULES",
    "Action",
    "LayerProfile",
    "Plan",
    "Schedule",
    "partition",
    "profile",
    "schedule",
]
