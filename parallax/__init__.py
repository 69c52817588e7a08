"""parallax: SPMD parallel training for JAX, from one pure Flax model.

Pick a mesh and a strategy, create the state sharded, decorate a step:

    mesh = px.make_mesh(data=2, fsdp=2, tensor=2)
    strategy = px.compose(px.DataParallel("data"), px.FSDP("fsdp"), px.TensorParallel("tensor"))
    state = px.init(lambda: px.TrainState.create(model_fn(), optax.adam(1e-3)), mesh, strategy)

    @px.train_step(mesh, strategy)
    def step(state, batch):
        loss, grads = px.value_and_grad(loss_fn)(state.model, batch)
        return state.apply_gradients(grads), {"loss": loss}
"""

from parallax import analysis as analysis
from parallax import checkpoint as checkpoint
from parallax import comm as comm
from parallax import data as data
from parallax import distributed as distributed
from parallax import metrics as metrics
from parallax import models as models
from parallax import nn as nn
from parallax import old_import_paths as _old_import_paths
from parallax import pipeline as pipeline
from parallax import planner as planner
from parallax import ps as ps
from parallax import rpc as rpc
from parallax import rules as rules
from parallax import testing as testing
from parallax import tf as tf
from parallax.activations import constrain as constrain
from parallax.grad import value_and_grad as value_and_grad
from parallax.loss_scale import dynamic_loss_scale as dynamic_loss_scale
from parallax.loss_scale import metrics as loss_scale_metrics
from parallax.mesh import make_hybrid_mesh as make_hybrid_mesh
from parallax.mesh import make_mesh as make_mesh
from parallax.metrics import profile as profile
from parallax.planner.choose import plan as plan
from parallax.planner.explain import explain as explain
from parallax.state import TrainState as TrainState
from parallax.step import EvalStep as EvalStep
from parallax.step import TrainStep as TrainStep
from parallax.step import eval_step as eval_step
from parallax.step import init as init
from parallax.step import shard as shard
from parallax.step import train_step as train_step
from parallax.strategies import AllReduceSync as AllReduceSync
from parallax.strategies import FSDP as FSDP
from parallax.strategies import HSDP as HSDP
from parallax.strategies import MixedPrecision as MixedPrecision
from parallax.strategies import Float8 as Float8
from parallax.strategies import add_float8_histories as add_float8_histories
from parallax.strategies import Pipeline as Pipeline
from parallax.strategies import ReduceToOne as ReduceToOne
from parallax.strategies import BucketedSync as BucketedSync
from parallax.strategies import ContextParallel as ContextParallel
from parallax.strategies import DataParallel as DataParallel
from parallax.strategies import ExpertParallel as ExpertParallel
from parallax.strategies import GradientAccumulation as GradientAccumulation
from parallax.strategies import TensorParallel as TensorParallel
from parallax.strategies import ZeRO as ZeRO
from parallax.strategy import Strategy as Strategy
from parallax.strategy import compose as compose

__version__ = "0.1.0"

_old_import_paths.install()  # scripts written against pre-round-3 paths keep running

__all__ = [
    "AllReduceSync",
    "BucketedSync",
    "ContextParallel",
    "DataParallel",
    "EvalStep",
    "ExpertParallel",
    "FSDP",
    "GradientAccumulation",
    "HSDP",
    "MixedPrecision",
    "Float8",
    "add_float8_histories",
    "Pipeline",
    "ReduceToOne",
    "Strategy",
    "TensorParallel",
    "TrainState",
    "TrainStep",
    "ZeRO",
    "analysis",
    "checkpoint",
    "comm",
    "compose",
    "constrain",
    "data",
    "distributed",
    "dynamic_loss_scale",
    "eval_step",
    "explain",
    "init",
    "loss_scale_metrics",
    "make_hybrid_mesh",
    "make_mesh",
    "metrics",
    "models",
    "nn",
    "pipeline",
    "planner",
    "ps",
    "rpc",
    "plan",
    "profile",
    "rules",
    "shard",
    "testing",
    "tf",
    "train_step",
    "value_and_grad",
]
