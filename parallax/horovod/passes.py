"""Backward passes per step: when ``hvd.DistributedOptimizer`` steps, as Horovod decides it.

``backward_passes_per_step=k`` accumulates gradients locally and synchronises and applies
them once per step. Each ``update`` call of the optimizer is one backward pass; Horovod's
two optimizers decide differently when the step is:

- **by default, Horovod's TensorFlow/Keras optimizer**
  (horovod/tensorflow/gradient_aggregation_eager.py, ``LocalGradientAggregationHelperEager``):
  a counter of passes; ``apply_gradients`` applies only on the pass that brings it to ``k``
  and is a no-op on the others. So the ``k``-th call steps and the others return zero
  updates.
- **with ``update(..., step=True | False)``, Horovod's torch optimizer**
  (horovod/torch/optimizer.py): hooks count each parameter's backward passes, and
  ``optimizer.step()`` synchronises and applies whatever has accumulated, however many
  passes that is (``synchronize`` all-reduces every gradient, even one whose count has not
  reached ``k``). ``step=False`` is a backward pass alone; ``step=True`` a backward pass
  followed by ``optimizer.step()``: a step after ``j < k`` passes applies the sum of the
  ``j``. A pass beyond ``k`` before a step is an error, as the hook asserts that it sees at
  most ``k`` passes between steps; inside a program the pass count is traced, so a host
  callback raises it when the program runs (JAX then raises that error again at every later
  ``jax.effects_barrier()`` until another program with a host callback runs on the same
  devices: a failed host callback's error stays in JAX's per-device runtime tokens).

Horovod sums the passes (the torch optimizer lets ``p.grad`` accumulate;
horovod/tensorflow/gradient_aggregation.py and gradient_aggregation_eager.py divide by ``k``
only with ``average_aggregated_gradients=True``, default False), which is also what DDP's
``no_sync`` gives, and so does :func:`accumulate` (the optimizer applies that flag's
division, by ``k``, in its ``apply``). So ``k`` micro-batches of ``B/k`` rows with mean
losses step like one batch of ``B`` with ``k`` times the gradient; pass
``average_aggregated_gradients=True`` (or divide the loss by ``k``, as PyTorch users do) for
exactly the big batch. (``px.GradientAccumulation`` and ``px.value_and_grad(microbatches=)``
take the mean instead: they split one batch.) An early step with
``average_aggregated_gradients=True`` still divides by ``k``: the flag is TensorFlow
Horovod's, whose optimizer never steps early, and torch's optimizer has no such flag.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def check_step(api: str, step, k: int) -> None:
    """``step`` is None, a bool (or a traced bool inside a program), and meaningful for ``k``."""
    if step is None or isinstance(step, jax.Array) and step.dtype == jnp.bool_:
        return
    if not isinstance(step, (bool, np.bool_)):
        raise TypeError(f"{api}: step must be None (step every backward_passes_per_step "
                        f"passes), True or False, got {type(step).__name__}: {step!r}.")
    if k == 1 and not step:
        raise ValueError(f"{api}: step=False with backward_passes_per_step=1: each update "
                         "call is one backward pass, and every pass is a step. Create the "
                         "optimizer with backward_passes_per_step > 1 to accumulate passes.")


def too_many_passes(api: str, k: int) -> str:
    return (f"{api}: more than backward_passes_per_step={k} backward passes (update calls "
            f"with step=False) before a step, which Horovod's torch optimizer refuses too. "
            f"Pass step=True on the pass that ends the step (at the latest on pass {k}), or "
            f"create the optimizer with a larger backward_passes_per_step.")


def _check_count(api: str, k: int, count):
    if int(count) > k:
        raise ValueError(too_many_passes(api, k))
    return np.asarray(count)


def accumulate(api: str, grads, accumulated, count, inner, apply, *, k: int, step, eager: bool):
    """One backward pass: adds ``grads`` and steps when Horovod would.

    Args:
      api: the caller's name (messages).
      grads: this pass's gradients.
      accumulated: the sum of the passes since the last step; ``count`` their number.
      inner: the wrapped optimizer's state (kept when nothing is applied).
      apply: ``apply(total) -> (updates, inner)``: synchronise and apply the sum.
      k: ``backward_passes_per_step``.
      step: None (the ``k``-th pass steps), or whether this pass ends with a step.
      eager: outside a program (Python decides; the count is concrete).

    Returns:
      ``(updates, inner, accumulated, count)``: zero updates and the grown sum when no step
      happens; the applied updates and a zero sum after a step.

    Example:
      >>> import jax.numpy as jnp
      >>> apply = lambda total: (total, "stepped")
      >>> out = accumulate("demo", jnp.ones(2), jnp.zeros(2), jnp.int32(0), "inner", apply,
      ...                  k=2, step=True, eager=True)   # an early step: one pass's sum
      >>> out[0].tolist(), out[1], int(out[3])
      ([1.0, 1.0], 'stepped', 0)
    """
    accumulated = jax.tree.map(jnp.add, accumulated, grads)
    count = count + 1

    def stepped(_):
        updates, new_inner = apply(accumulated)
        return updates, new_inner, jax.tree.map(jnp.zeros_like, accumulated), jnp.zeros_like(count)

    def waited(_):
        return jax.tree.map(jnp.zeros_like, grads), inner, accumulated, count

    stepping = count >= k if step is None else step
    if eager:
        if step is not None and int(count) > k:
            raise ValueError(too_many_passes(api, k))
        return stepped(None) if bool(stepping) else waited(None)
    if step is not None:
        # A traced count cannot raise here: the host checks it, in a callback whose result
        # the program uses (so it runs before the count is read, and raises there).
        count = jax.pure_callback(functools.partial(_check_count, api, k),
                                  jax.ShapeDtypeStruct(count.shape, count.dtype), count)
    return lax.cond(jnp.asarray(stepping, bool), stepped, waited, None)
