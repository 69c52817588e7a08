"""parallax: SPMD parallel training for JAX, from one pure Flax model."""

from parallax import analysis as analysis
from parallax import rules as rules
from parallax.mesh import make_hybrid_mesh as make_hybrid_mesh
from parallax.mesh import make_mesh as make_mesh
from parallax.rules import constrain as constrain

__version__ = "0.1.0"
