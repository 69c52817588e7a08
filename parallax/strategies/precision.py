"""``px.MixedPrecision``: a step's dtypes as a strategy, composable with every parallelism.

The policy (:class:`parallax.precision.Policy`) is carried in ``Strategy.precision`` and
applied by ``px.value_and_grad`` to any model, stock ``nnx`` layers included: the stored
parameters and the batch's floating leaves are cast to ``compute`` inside the
differentiated function (the gradient reaches the ``params``-dtype master copy through
the cast), the loss comes back in float32, the explicit style's cross-device gradient sum
runs in ``reduce`` and the gradients are returned in ``grads``. With ``loss_scale`` the
loss is scaled by the optimizer's :func:`parallax.loss_scale.dynamic_loss_scale` state.

Under ``px.Pipeline`` the policy is applied to each stage's piece of the loss (compute
dtype, activations sent in it, the stage-axis gradient sum in ``reduce``; see
:func:`parallax.pipeline.runtime.program.program`); ``weights="stashed"`` refuses it.

What it does not do: the GSPMD style (``style="gspmd"``) leaves the gradient sum to XLA's
partitioner, which all-reduces each weight-gradient matmul's partial result in that
matmul's dtype (the compute dtype), before any cast parallax could place; so ``reduce``
applies to the explicit style only (docs/mixed_precision.md). A model that casts its
parameters itself (``GPTConfig(dtype=...)``, ``nnx.Linear(dtype=...)``) computes in its
own dtype.

References:
  Micikevicius et al., "Mixed Precision Training", ICLR 2018; DeepMind JMP
  (``jmp.get_policy("params=float32,compute=bfloat16,output=float32")``).
"""

from __future__ import annotations

from parallax.precision import Policy
from parallax.strategy import Strategy


def MixedPrecision(params: str = "float32", compute: str = "bfloat16", grads: str = "float32",
                   reduce: str = "float32", loss_scale: str | None = "default") -> Strategy:
    """A strategy that only sets the step's dtypes; compose it with the parallelisms.

    Args:
      params: storage dtype of the trained parameters (the master copy): checked.
      compute: dtype of the forward and backward passes.
      grads: dtype of the gradients ``px.value_and_grad`` returns.
      reduce: dtype of the cross-device gradient sum (explicit style; in a pipeline also
        the stage-axis sum): ``"bfloat16"`` halves its bytes.
      loss_scale: ``"dynamic"`` or None; the default is dynamic for float16 compute (wrap
        the optimizer with ``px.dynamic_loss_scale``), None otherwise.

    Returns:
      A :class:`parallax.Strategy` holding only the policy.

    Raises:
      ValueError: a dtype name that is not float32, bfloat16 or float16.

    Example:
      >>> import parallax as px
      >>> s = px.compose(px.DataParallel("data"), px.MixedPrecision(reduce="bfloat16"))
      >>> s.precision.describe()
      'params=float32, compute=bfloat16, grads=float32, reduce=bfloat16'
    """
    policy = Policy(params, compute, grads, reduce, loss_scale)
    scale = f", loss_scale={policy.loss_scale!r}" if policy.loss_scale else ""
    name = (f"MixedPrecision(params={policy.params!r}, compute={policy.compute!r}, "
            f"grads={policy.grads!r}, reduce={policy.reduce!r}{scale})")
    return Strategy(name=name, precision=policy)
