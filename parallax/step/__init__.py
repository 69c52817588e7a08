"""Around the user's step: ``px.init`` and ``px.shard`` (state placed on the mesh),
``@px.train_step`` (one jitted SPMD program), ``@px.eval_step`` (forward only, the state
in place), the batch (its spec, checks, assembly from
several processes), and the boundary checks that put a clear message in front of JAX's.
``check_finite``'s records are :mod:`parallax.finite_check`'s (models record into them too)."""

from parallax.step.eval_step import EvalStep as EvalStep
from parallax.step.eval_step import eval_step as eval_step
from parallax.step.placement import checked_strategy as checked_strategy
from parallax.step.placement import init as init
from parallax.step.placement import shard as shard
from parallax.step.spmd_step import TrainStep as TrainStep
from parallax.step.spmd_step import train_step as train_step
