"""Reading compiled programs: collectives in the partitioned HLO, memory per device, and the
formulas they are compared with (ZeRO's memory, Megatron's traffic)."""

from parallax.analysis import hlo as hlo
from parallax.analysis import memory as memory
from parallax.analysis import tensor_traffic as tensor_traffic
