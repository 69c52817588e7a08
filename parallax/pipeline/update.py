"""``px.pipeline.update``: one training step's update, as ``px.Pipeline(weights=...)`` says.

PipeDream's three ways of keeping weight versions:

* ``"flush"`` (PipeDream-flush, 1F1B's synchronous default): one version per step;
  ``px.pipeline.update`` is ``px.value_and_grad`` then ``state.apply_gradients``.
* ``"2bw"`` (PipeDream-2BW): two versions; the step's gradient, accumulated over its
  micro-batches, is computed at the previous version and applied to the current one,
  ``W(t + 1) = W(t) - lr * grad f(W(t - 1))``. The previous version lives in the optimizer
  state (``px.pipeline.double_buffered(tx)``), so ``state.apply_gradients`` still applies
  the update.
* ``"stashed"`` (PipeDream): every stage updates its layers after each micro-batch's
  backward, inside the pipeline, each backward on the version its forward used; the
  optimizer runs in the tick loop, so this step does not go through
  ``state.apply_gradients`` (it applies ``state.tx`` itself, ``microbatches`` times, and
  advances ``state.step`` by as many).

The strategy's ``px.value_and_grad`` path stays the way to write a flushed step; with the
other two it raises and names this function.
"""

from __future__ import annotations

from flax import nnx

from parallax import context
from parallax.grad.gradients import value_and_grad
from parallax.grad.module_state import StateOptions, Target
from parallax.pipeline.runtime import module_state
from parallax.pipeline.producer import FROM_UPDATE, PipelineProducer
from parallax.pipeline.runtime.gradients import pipeline_update
from parallax.pipeline.runtime.settings import PipelineSettings
from parallax.pipeline.stages import Stages
from parallax.pipeline.versions import DoubleBufferedState

API = "px.pipeline.update"


def update(loss: Stages, state, batch):
    """One step of a pipelined ``loss``: ``(new_state, loss_value)``, weights as configured.

    Call it inside ``px.train_step`` with a strategy that holds ``px.Pipeline``; the
    weight-version mode is the strategy's (``weights="flush" | "stashed" | "2bw"``).

    Args:
      loss: the pipelined loss (:class:`parallax.pipeline.Stages`).
      state: a ``px.TrainState``; for ``"2bw"`` created with
        ``px.pipeline.double_buffered(tx)`` as its optimizer.
      batch: the step's batch.

    Returns:
      ``(new_state, loss)``; the loss is the mean over micro-batches (with ``"stashed"``,
      each at the weights its forward saw).

    Raises:
      ValueError: outside a pipelined step, for ``"2bw"`` without the double-buffered
        optimizer, or for ``"stashed"`` with data-parallel or ZeRO axes (the updates happen
        inside the pipeline, after every micro-batch, on the stage axis alone).

    Example:
      >>> import jax, jax.numpy as jnp, optax, parallax as px
      >>> from flax import nnx
      >>> from parallax.models.gpt_pipeline import next_token_stages
      >>> mesh = px.make_mesh(stage=2, devices=jax.devices()[:2])
      >>> strategy = px.Pipeline("stage", microbatches=2, weights="stashed", remat="never")
      >>> config = px.models.GPTConfig.tiny()
      >>> state = px.init(lambda: px.TrainState.create(
      ...     px.models.GPT(config, rngs=nnx.Rngs(0)), optax.sgd(0.1)), mesh, strategy)
      >>> @px.train_step(mesh, strategy)
      ... def step(state, batch):
      ...     state, loss = px.pipeline.update(next_token_stages, state, batch)
      ...     return state, {"loss": loss}
      >>> tokens = jnp.arange(4 * 65, dtype=jnp.int32).reshape(4, 65) % 256
      >>> state, metrics = step(state, {"tokens": tokens})
      >>> int(state.step)                     # one update per micro-batch
      2

    References:
      Narayanan et al. 2019, PipeDream (weight stashing); Narayanan et al. 2021,
      Memory-Efficient Pipeline-Parallel DNN Training (PipeDream-flush, PipeDream-2BW).
    """
    ctx = context.current()
    producer = ctx.strategy.grad_fn if ctx is not None else None
    if not isinstance(producer, PipelineProducer):
        where = "outside px.train_step" if ctx is None else f"with {ctx.strategy.name}"
        raise ValueError(
            f"{API}: called {where}; it runs inside a step decorated with "
            "px.train_step(mesh, strategy) whose strategy holds px.Pipeline(...)"
        )
    if not isinstance(loss, Stages):
        raise TypeError(f"{API}: the loss must be a px.pipeline.Stages, got "
                        f"{type(loss).__name__}")
    for field in ("graphdef", "params", "rest", "opt_state", "tx"):
        if not hasattr(state, field):
            raise TypeError(f"{API}: state must be a px.TrainState, got {type(state).__name__}")
    settings = producer.settings
    if settings.weights == "flush":
        value, grads = value_and_grad(loss)(state.model, batch)
        return state.apply_gradients(grads), value
    if settings.weights == "2bw":
        return _two_versions(loss, state, batch)
    return _stashed(loss, state, batch, settings, ctx)


def _two_versions(loss, state, batch):
    previous = state.opt_state
    if not isinstance(previous, DoubleBufferedState):
        raise ValueError(
            f"{API}: px.Pipeline(weights='2bw') computes the step's gradient at the previous "
            "weight version, which the optimizer keeps: create the state with "
            "px.TrainState.create(model, px.pipeline.double_buffered(tx)); got an optimizer "
            f"state of type {type(previous).__name__}"
        )
    model = nnx.merge(state.graphdef, previous.previous, state.rest)
    value, grads = value_and_grad(loss)(model, batch, *FROM_UPDATE)
    return state.apply_gradients(grads), value


def _stashed(loss, state, batch, settings: PipelineSettings, ctx):
    axes = [a for a in ctx.strategy.batch_axes if a in ctx.mesh.shape and ctx.mesh.shape[a] > 1]
    if axes:
        raise ValueError(
            f"{API}: px.Pipeline(weights='stashed') updates the weights inside the pipeline "
            f"after every micro-batch, on the stage axis alone; {ctx.strategy.name} also "
            f"splits the batch over {tuple(axes)}, whose gradients would have to be summed "
            "inside the tick loop. Use weights='2bw' or 'flush' with data parallelism, or a "
            "mesh without those axes"
        )
    policy = ctx.strategy.precision
    if policy is not None:
        raise ValueError(
            f"{API}: px.Pipeline(weights='stashed') applies the optimizer inside the pipeline "
            f"after every micro-batch, where the precision policy ({policy.describe()}) does "
            "not reach (its stages compute in the parameters' dtype). Use weights='2bw' or "
            "'flush' with px.MixedPrecision, or leave px.MixedPrecision out")
    parts = Target.of(state.model)
    if module_state.carries_state(parts):
        module_state.check(parts, StateOptions(), "px.Pipeline", "stashed")
    graphdef, rest = state.graphdef, state.rest
    value, params, opt_state = pipeline_update(
        loss, state.params, lambda p: nnx.merge(graphdef, p, rest), batch, state.tx,
        state.opt_state, settings, api=API)
    return state.replace(step=state.step + settings.microbatches, params=params,
                         opt_state=opt_state), value
