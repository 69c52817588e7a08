"""Pipeline parallelism: schedules as data, one SPMD runtime, partitioning, profiling.

A schedule is a validated table (tick x stage -> action) that a lock-step SPMD runtime reads
directly; it is printed, plotted and costed before anything runs:

    s = px.pipeline.schedule("1f1b", stages=4, microbatches=8)
    print(s.text())
    s.bubble_fraction(f=1, b=1, w=1)   # the papers' bubble: 3/11 (lockstep=True: what ticks pay)
    s.as_arrays()                      # int arrays [ticks, stages] and the buffer plan

    records = px.pipeline.profile_layers(layers, sample)
    split = px.pipeline.partition(records, stages=4, method="pipedream", bandwidth=1e10)

The runtime executes any schedule's table in one ``jit`` (``shard_map`` over the stage axis,
a ``lax.scan`` over ticks); a pipelined loss is a :class:`Stages` value:

    loss = px.pipeline.Stages(first, stage, last, layers)     # loss(model, batch) = sequential
    with jax.set_mesh(mesh):
        value, grads = jax.jit(px.pipeline.value_and_grad(loss, "1f1b", microbatches=8))(
            model, batch)

Inside ``px.train_step``, the ``Pipeline`` strategy (``parallax.strategies.pipeline``) does
the same from ``px.value_and_grad(loss)``; ``gpipe_value_and_grad`` is GPipe as a forward
scan differentiated by autodiff, and ``split_value_and_grad`` the zero-bubble schedules'
B/W split of the backward on one device, with no pipeline (a reference for what the split
costs by itself).

See ``docs/pipeline.md`` for the tick model, the runtime, the formulas and measurements.
"""

from parallax.pipeline.planning.partition import METHODS as METHODS
from parallax.pipeline.planning.partition import Partition as Partition
from parallax.pipeline.planning.partition import partition as partition
from parallax.pipeline.planning.profile import LayerProfile as LayerProfile
from parallax.pipeline.planning.profile import profile_layers as profile_layers
from parallax.pipeline.runtime.gpipe import gpipe_value_and_grad as gpipe_value_and_grad
from parallax.pipeline.runtime.checks import POLICIES as POLICIES
from parallax.pipeline.runtime.checks import REMAT as REMAT
from parallax.pipeline.runtime.gradients import value_and_grad as value_and_grad
from parallax.pipeline.runtime.sequential_split import (
    split_value_and_grad as split_value_and_grad)
from parallax.pipeline.schedules import SCHEDULES as SCHEDULES
from parallax.pipeline.schedules import Action as Action
from parallax.pipeline.schedules import Placement as Placement
from parallax.pipeline.schedules import Schedule as Schedule
from parallax.pipeline.schedules import schedule as schedule
from parallax.pipeline.runtime.settings import WEIGHTS as WEIGHTS
from parallax.pipeline.stages import Stages as Stages
from parallax.pipeline.update import update as update
from parallax.pipeline.versions import double_buffered as double_buffered
from parallax.old_import_paths import renamed_names as _renamed_names

__all__ = [
    "METHODS",
    "POLICIES",
    "REMAT",
    "SCHEDULES",
    "WEIGHTS",
    "Action",
    "LayerProfile",
    "Partition",
    "Placement",
    "Schedule",
    "Stages",
    "double_buffered",
    "gpipe_value_and_grad",
    "partition",
    "profile_layers",
    "schedule",
    "split_value_and_grad",
    "update",
    "value_and_grad",
]

__getattr__ = _renamed_names("parallax.pipeline", globals())  # old names, with a warning
