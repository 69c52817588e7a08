"""``px.MixedPrecision``: a step's dtypes as a strategy, composable with every parallelism.

The policy (:class:`parallax.precision.Policy`) is carried in ``Strategy.precision`` and
applied by ``px.value_and_grad`` to any model, stock ``nnx`` layers included: the stored
parameters and the batch's floating leaves are cast to ``compute`` inside the
differentiated function (the gradient reaches the ``params``-dtype master copy through
the cast), the loss comes back in float32, the explicit style's cross-device gradient sum
runs in ``reduce`` and the gradients are returned in ``grads``. With ``loss_scale`` the
loss is scaled by the optimizer's :func:`parallax.loss_scale.dynamic_loss_scale` state.

What it does not do: the GSPMD style (``style="gspmd"``) leaves the gradient sum to XLA,
which reduces in whatever dtype its partitioner chooses, so ``reduce`` applies to the
explicit style only; a model that casts its parameters itself (``GPTConfig(dtype=...)``,
``nnx.Linear(dtype=...)``) computes in its own dtype; ``px.Pipeline``'s runtime calls the
stages itself, so the policy does not reach its forward pass (untested there).

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
      reduce: dtype of the cross-device gradient sum (explicit style): ``"bfloat16"``
        halves its bytes.
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
