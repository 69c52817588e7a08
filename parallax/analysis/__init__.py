"""Reading compiled programs, and predicting them: collectives in the partitioned HLO,
memory per device, the formulas they are compared with (ZeRO's memory, Megatron's traffic,
the pipeline's bubble), ``px.explain`` (predicted next to measured) and ``px.plan`` (a
planner that proposes a mesh and a strategy)."""

from parallax.analysis import auto as auto
from parallax.analysis import explain as explain
from parallax.analysis import hlo as hlo
from parallax.analysis import memory as memory
from parallax.analysis import program as program
from parallax.analysis import roofline as roofline
from parallax.analysis import tensor_traffic as tensor_traffic
