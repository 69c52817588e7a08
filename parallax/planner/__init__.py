"""Predicting and choosing: ``px.explain`` (predicted next to compiled), the published
formulas it predicts with (:mod:`parallax.planner.predicted`: ZeRO's memory, Megatron's
traffic, the pipeline's bubble and peak in flight), the roofline, and ``px.plan``
(candidates enumerated, predicted, the best compiled). It reads compiled programs through
:mod:`parallax.analysis` and enumerates the strategies and pipeline schedules, so it sits
above both."""

from parallax.old_import_paths import renamed_names as _renamed_names
from parallax.planner import candidates as candidates
from parallax.planner import choose as choose
from parallax.planner import explain as explain
from parallax.planner import predicted as predicted
from parallax.planner import roofline as roofline
from parallax.planner import topology as topology

# px.planner.zero_memory and the other modules that moved into predicted/, with a warning.
__getattr__ = _renamed_names("parallax.planner", globals())
