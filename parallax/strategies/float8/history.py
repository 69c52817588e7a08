"""Delayed scaling's state: each converted layer's amax history and scales, in the model.

``px.Float8(delayed=True)`` quantizes with scales computed from past steps' amaxes
(Transformer Engine's ``DelayedScaling``), so they must live across steps as model state,
next to BatchNorm statistics and RNG counters: carried by ``px.train_step`` /
``px.TrainState``, placed by every strategy (replicated: a few floats per layer), saved by
``px.checkpoint``. :func:`add_float8_histories` adds them to each converted dense layer,
once, before ``px.TrainState.create``:

- ``float8_history``: :class:`Float8History` ``[amax_history_len, 3]`` float32, the
  columns x, w, g (input, weight, output gradient), slot 0 the running step's;
- ``float8_scale``: :class:`Float8History` ``[3]`` float32, the scales this step uses
  (1.0 at first, as TE);
- ``float8_grad_amax``: :class:`Float8GradAmax` ``[]``, this step's gradient amax, out of
  the backward (a :class:`parallax.grad.backward_records.BackwardRecord`).

Per step: the forward and backward record their amaxes (:mod:`.delayed_matmul`); then
:class:`UpdateScales` (a ``ModelHooks.after_grad`` entry, once per ``px.value_and_grad``)
folds the gradient amax into slot 0 and runs
:func:`parallax.strategies.float8.scaling.amax_and_scale_update` on each column: the next
scales, the history rolled.

Layers stacked with ``nnx.vmap`` (``px.models.GPT``'s blocks) get stacked variables (a
leading dimension per stacked one), which ``nnx.scan`` slices with the layer, so each layer
keeps its own history.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from parallax.grad.backward_records import BackwardRecord
from parallax.strategies.float8 import scaling
from parallax.strategies.float8.delayed_matmul import G, DelayedDot
from parallax.strategies.float8.modules import dense_modules, unstacked_kernel_ndim
from parallax.strategies.float8.recipe import API, Float8Recipe

FORMATS = (scaling.FORWARD, scaling.FORWARD, scaling.BACKWARD)  # x, w, g
NAMES = ("float8_history", "float8_scale", "float8_grad_amax")


class Float8History(nnx.Variable):
    """Delayed float8 scaling's amax history and scales of one dense layer."""


class Float8GradAmax(BackwardRecord):
    """A dense layer's output-gradient amax of the step, written by its backward pass."""


def recipe_of(strategy) -> Float8Recipe:
    """The float8 recipe of a strategy holding ``px.Float8`` (or the recipe itself)."""
    if isinstance(strategy, Float8Recipe):
        return strategy
    float8 = getattr(strategy, "float8", None)
    if float8 is None:
        raise ValueError(f"px.add_float8_histories: {getattr(strategy, 'name', strategy)} "
                         "holds no px.Float8; pass the strategy the step runs with, e.g. "
                         "px.compose(px.DataParallel(), px.Float8(delayed=True)).")
    return float8.recipe


def add_float8_histories(model: nnx.Module, strategy) -> nnx.Module:
    """Adds delayed scaling's amax histories and scales to the model's converted layers.

    Call it once, after building the model and before ``px.TrainState.create``; layers
    that already have them are left as they are. Under current scaling it does nothing.

    Args:
      model: the NNX model.
      strategy: the strategy the step runs with (holding ``px.Float8(delayed=True)``), or
        its :class:`Float8Recipe`.

    Returns:
      ``model``, changed in place.

    Raises:
      ValueError: the strategy holds no ``px.Float8``.

    Example:
      >>> import parallax as px
      >>> from flax import nnx
      >>> model = px.add_float8_histories(nnx.Linear(4, 2, rngs=nnx.Rngs(0)),
      ...                                 px.Float8(delayed=True, amax_history_len=8))
      >>> model.float8_history.shape, model.float8_scale[...].tolist()
      ((8, 3), [1.0, 1.0, 1.0])
    """
    recipe = recipe_of(strategy)
    if not recipe.delayed:
        return model
    for path, module in dense_modules(model, recipe):
        if hasattr(module, NAMES[0]):
            continue
        ndim = unstacked_kernel_ndim(module)
        # nnx.vmap-stacked layers get stacked histories: nnx.scan slices them with the layer.
        lead = module.kernel[...].shape[:module.kernel[...].ndim - ndim] if ndim else ()
        length = recipe.amax_history_len
        module.float8_history = Float8History(jnp.zeros((*lead, length, 3), jnp.float32))
        module.float8_scale = Float8History(jnp.ones((*lead, 3), jnp.float32))
        module.float8_grad_amax = Float8GradAmax(jnp.zeros(lead, jnp.float32))
    return model


def check_prepared(path: str, module) -> None:
    """Raises when a converted layer has no history (the model was not prepared)."""
    if not all(isinstance(getattr(module, n, None), nnx.Variable) for n in NAMES):
        raise ValueError(
            f"{API}(delayed=True): layer {path or '<root>'!r} ({type(module).__name__}) has "
            "no amax history. Delayed scaling keeps its histories in the model: call "
            "px.add_float8_histories(model, strategy) once after building the model, "
            "before px.TrainState.create.")


@dataclasses.dataclass(frozen=True)
class UseHistories:
    """A ``ModelHooks.before_loss`` entry: each converted layer's ``dot_general`` becomes
    a :class:`.DelayedDot` reading its own history (on the module rebuilt inside the traced
    loss)."""

    recipe: Float8Recipe

    def __call__(self, model: nnx.Module) -> None:
        for path, module in dense_modules(model, self.recipe):
            check_prepared(path, module)
            module.dot_general = nnx.data(DelayedDot(module))


def update_scales(history, scale, grad_amax, recipe: Float8Recipe):
    """``(history, scale)`` after a step: the gradient amax in slot 0, then TE's update
    of each column (x and w in e4m3, g in e5m2); stacked layers each on their own."""
    if scale.ndim > 1:
        return jax.vmap(lambda h, s, g: update_scales(h, s, g, recipe))(history, scale,
                                                                          grad_amax)
    history = history.at[0, G].set(jnp.maximum(history[0, G], grad_amax))
    columns = [scaling.amax_and_scale_update(history[:, i], scale[i], dtype,
                                             algo=recipe.amax_compute_algo,
                                             margin=recipe.margin)
               for i, dtype in enumerate(FORMATS)]
    return (jnp.stack([h for h, _ in columns], axis=1),
            jnp.stack([s for _, s in columns]))


@dataclasses.dataclass(frozen=True)
class UpdateScales:
    """A ``ModelHooks.after_grad`` entry: every converted layer's scales for the next step
    from its history, the history rolled, the gradient amax cleared."""

    recipe: Float8Recipe

    def __call__(self, model: nnx.Module) -> None:
        for _, module in dense_modules(model, self.recipe):
            if not hasattr(module, NAMES[0]):
                continue  # the forward pass already refused an unprepared model
            history, scale = update_scales(module.float8_history[...],
                                           module.float8_scale[...],
                                           module.float8_grad_amax[...], self.recipe)
            module.float8_history[...] = history
            module.float8_scale[...] = scale
            module.float8_grad_amax[...] = jnp.zeros_like(module.float8_grad_amax[...])
