"""Reading compiled programs: the collectives in the partitioned HLO and their bytes, memory
per device, how often each computation runs (loops times their trip counts), the FLOPs and
bytes a program executes (the pipeline runtime's included), and the tensor-parallel traffic
a step really sends. What predicts and chooses from these readings is
:mod:`parallax.planner`."""

from parallax.analysis import executed as executed
from parallax.analysis import hlo as hlo
from parallax.analysis import program as program
from parallax.analysis import tensor_traffic as tensor_traffic
