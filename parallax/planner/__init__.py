"""Predicting and choosing: ``px.explain`` (predicted next to compiled), the published
formulas it predicts with (ZeRO's memory, Megatron's traffic, the pipeline's bubble and
peak in flight), the roofline, and ``px.plan`` (candidates enumerated, predicted, the best
compiled). It reads compiled programs through :mod:`parallax.analysis` and enumerates the
strategies and pipeline schedules, so it sits above both."""

from parallax.planner import candidates as candidates
from parallax.planner import choose as choose
from parallax.planner import explain as explain
from parallax.planner import pipeline_memory as pipeline_memory
from parallax.planner import predicted_memory as predicted_memory
from parallax.planner import predicted_traffic as predicted_traffic
from parallax.planner import roofline as roofline
from parallax.planner import zero_memory as zero_memory
