"""``px.Float8``: the dense matmuls of any model in float8, as a composable strategy.

Files: ``scaling.py`` (amaxes, scales, casts, delayed scaling's history update),
``recipe.py`` (the validated settings), ``matmul.py`` (the float8 ``dot_general`` and its
backward), ``modules.py`` (which layers, and the hook that switches them),
``fsdp_gather.py`` (ZeRO 3's all-gather in float8), ``history.py`` and
``delayed_matmul.py`` (delayed scaling: the histories as model state, the matmul that
reads and records them).

(Partly built: delayed scaling refuses micro-batches and pipelines: see docs/float8.md.)
"""

from __future__ import annotations

from parallax.strategies.float8.fsdp_gather import Float8Matmuls
from parallax.strategies.float8.history import (Float8GradAmax, Float8History, UpdateScales,
                                                UseHistories, add_float8_histories)
from parallax.strategies.float8.modules import Float8Modules
from parallax.strategies.float8.recipe import Float8Recipe
from parallax.strategy import ModelHooks, Strategy


def Float8(scaling: str = "tensorwise", *, delayed: bool = False, amax_history_len: int = 16,
           amax_compute_algo: str = "max", margin: float = 0.0,
           power_of_2_scales: bool | None = None, fsdp_float8_gather: bool | None = None,
           skip: tuple[str, ...] = ()) -> Strategy:
    """Runs the dense layers' matmuls in float8: e4m3 forward, e5m2 gradients.

    Every ``nnx.Linear`` and ``parallax.nn.Dense`` of the model (its ``dot_general``) is
    switched, inside the traced step only, to three float8 matmuls with float32 sums
    (:mod:`parallax.strategies.float8.matmul`); the model and its parameters are not
    changed. Compose it with ``px.MixedPrecision()`` for bfloat16 compute around the
    matmuls with float32 master parameters and optimizer state (Transformer Engine's and
    torchao's setting), and with any parallelism: under ZeRO 3 / FSDP (explicit style) the
    weights are all-gathered in float8 (tensorwise, current scaling), under tensor
    parallelism the amaxes of split tensors are reduced by XLA over the tensor axis.

    With ``delayed=True`` (Transformer Engine's ``DelayedScaling``) each layer quantizes
    with scales from its amax history of past steps, which lives in the model as
    :class:`Float8History` state: call ``px.add_float8_histories(model, strategy)`` once
    before ``px.TrainState.create`` (a step on a model without them raises, naming the
    call). The histories are then carried by the train step and saved by checkpoints.
    Layers stacked with ``nnx.vmap`` (``px.models.GPT``'s and ``Llama``'s blocks) get one
    history per layer. (Partly built: delayed scaling refuses micro-batches and pipelines.)

    Args:
      scaling: ``"tensorwise"`` (one scale per tensor; torchao's default recipe) or
        ``"rowwise"`` (one per row of the dimensions each matmul contracts; torchao's
        ``ROWWISE`` recipe).
      delayed: Transformer Engine's delayed scaling (scales from an amax history of the
        steps before; tensorwise only).
      amax_history_len, amax_compute_algo, margin: delayed scaling's settings (TE's
        names and meanings; TE's default history is 1024 steps, here 16).
      power_of_2_scales: round scales down to powers of two; default True for rowwise
        and False for tensorwise, as torchao's recipes.
      fsdp_float8_gather: ZeRO 3 gathers dense weights in float8; default True for
        tensorwise current scaling (rowwise cannot: one scale per gathered weight is
        needed; delayed does not: its weight scale comes from the history).
      skip: module-path substrings whose layers stay in high precision
        (``skip=("head",)``; torchao's ``module_filter_fn``).

    Returns:
      A :class:`parallax.Strategy` holding the recipe and the hook that switches layers.

    Raises:
      ValueError: an unknown scaling or amax algorithm, a non-positive history length,
        ``fsdp_float8_gather=True`` with rowwise or delayed scaling, delayed rowwise
        scaling.
      TypeError: ``skip`` not a tuple of strings.

    Example:
      >>> import parallax as px
      >>> s = px.compose(px.FSDP("fsdp"), px.Float8(), px.MixedPrecision())
      >>> s.float8.recipe.describe()
      'tensorwise, current scaling, e4m3 forward / e5m2 gradients, FSDP gathers in float8'

    References:
      Micikevicius et al., "FP8 Formats for Deep Learning", 2022; torchao
      ``torchao/float8`` (``convert_to_float8_training``, ``Float8LinearConfig``);
      NVIDIA Transformer Engine (``DelayedScaling``, ``Float8CurrentScaling``).
    """
    recipe = Float8Recipe(scaling, delayed, amax_history_len, amax_compute_algo, margin,
                          power_of_2_scales, fsdp_float8_gather, tuple(skip)
                          if not isinstance(skip, str) else skip)
    if recipe.delayed:
        hooks = ModelHooks(before_loss=(UseHistories(recipe),), after_grad=(UpdateScales(recipe),))
    else:
        hooks = ModelHooks(before_loss=(Float8Modules(recipe),))
    name = f"Float8({scaling!r}, delayed=True)" if delayed else f"Float8({scaling!r})"
    return Strategy(name=name, float8=Float8Matmuls(recipe), model_hooks=hooks)


__all__ = ["Float8", "Float8GradAmax", "Float8History", "Float8Matmuls", "Float8Modules",
           "Float8Recipe", "add_float8_histories"]
