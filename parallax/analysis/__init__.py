"""Reading compiled programs: collectives in the partitioned HLO, and memory per device."""

from parallax.analysis import hlo as hlo
from parallax.analysis import memory as memory
