"""Held-out loss and perplexity every N steps, under the training mesh and strategy.

:class:`Evaluation` runs a language model's loss over a held-out set with a jitted
forward-only step (``px.eval_step``: the training state in place, the batch split as in
training, the model under the strategy's rules) and reports the loss per counted target
token and its perplexity, ``exp(loss)``. Each batch's loss is a mean over its ``B * T``
target positions (``px.models.next_token_loss``'s convention, in which the targets a packed
batch does not count add zero); the evaluation multiplies it back into a sum, adds the sums
of all batches and divides by the targets counted (``parallax.models.packed_batch``), so
the result is the exact per-token mean over the whole held-out set, whatever the batching,
the padding of its last batch, or the number of processes.

References:
  Jelinek et al. 1977 (perplexity); torchtitan's and Levanter's periodic evaluation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np

from parallax.models.packed_batch import counted_targets
from parallax.state import TrainState
from parallax.step.eval_step import eval_step

API = "px.metrics.Evaluation"


def _host_float(value) -> float:
    """A scalar result of a step as a float, on any process (the scalar is replicated)."""
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        value = value.addressable_data(0)
    return float(np.asarray(value))


class Evaluation:
    """Held-out loss and perplexity of the training state, every ``every`` steps.

    Args:
      loss_fn: ``loss_fn(model, batch) -> scalar``, the mean over the batch's ``B * T``
        target positions (``px.models.next_token_loss``; targets not counted add zero).
      batches: the held-out batches, iterated anew by each evaluation (e.g.
        ``px.data.PackedBatches(held_out, ..., epochs=1, shuffle=False)``: every held-out
        token once; in a multi-process run, this process's rows).
      mesh, strategy: the training mesh and strategy.
      every: evaluate when the step number is a multiple of this (:meth:`due`).
      prefix: of the reported names (``eval_loss``, ``eval_perplexity``, ``eval_tokens``).
      progress: a bar over the held-out batches (process 0).

    Calling it on a state returns the metrics dict (``model`` is ``state.model`` for a
    ``px.TrainState``, else the state itself); ``monitor.record(metrics)`` logs them and
    keeps them in the progress bar.

    Example:
      >>> import optax, parallax as px
      >>> from flax import nnx
      >>> corpus = px.data.Corpus.from_documents([[1, 2, 3, 4, 5]] * 6)
      >>> held_out = px.data.PackedBatches(corpus, seq_len=8, global_batch=8, epochs=1,
      ...                                  shuffle=False, threads=0)
      >>> mesh, strategy = px.make_mesh(data=-1), px.DataParallel("data")
      >>> state = px.init(lambda: px.TrainState.create(
      ...     px.models.GPT(px.models.GPTConfig.tiny(), rngs=nnx.Rngs(0)), optax.sgd(0.1)),
      ...     mesh, strategy)
      >>> evaluation = px.metrics.Evaluation(px.models.next_token_loss, held_out,
      ...                                    mesh=mesh, strategy=strategy, every=100)
      >>> metrics = evaluation(state)
      >>> metrics["eval_tokens"], 200 < metrics["eval_perplexity"] < 320, evaluation.due(200)
      (24, True, True)
    """

    def __init__(self, loss_fn: Callable, batches: Iterable, *, mesh, strategy=None,
                 every: int, prefix: str = "eval_", progress: bool | str = False):
        if not callable(loss_fn):
            raise TypeError(f"{API}: loss_fn must be a function loss_fn(model, batch) -> "
                            f"scalar (e.g. px.models.next_token_loss), got "
                            f"{type(loss_fn).__name__}.")
        if iter(batches) is batches:
            raise TypeError(f"{API}: batches must be iterable again for every evaluation "
                            f"(a list, or px.data.PackedBatches(..., epochs=1)), not a "
                            f"one-shot iterator ({type(batches).__name__}).")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"{API}: every={every!r} must be an int >= 1 (steps between "
                             "evaluations).")
        self.loss_fn, self.batches, self.every = loss_fn, batches, every
        self.prefix, self.progress = prefix, progress

        @eval_step(mesh, strategy)
        def sums(state, batch):
            model = state.model if isinstance(state, TrainState) else state
            tokens = batch["tokens"]
            positions = tokens.shape[0] * (tokens.shape[1] - 1)
            return {"loss_sum": loss_fn(model, batch) * positions,
                    "tokens": counted_targets(batch)}

        self.step = sums

    def due(self, step: int) -> bool:
        """Whether step ``step`` (1-based, as ``state.step`` after it) evaluates."""
        return int(step) % self.every == 0

    def __call__(self, state) -> dict[str, Any]:
        """``{prefix + "loss", prefix + "perplexity", prefix + "tokens"}`` over all held-out
        batches."""
        batches = self.batches
        show = jax.process_index() == 0 if self.progress == "auto" else bool(self.progress)
        if show:
            from tqdm.auto import tqdm

            batches = tqdm(batches, desc="evaluating", unit="batch", leave=False)
        results = [self.step(state, batch) for batch in batches]
        total = sum(_host_float(r["loss_sum"]) for r in results)
        count = sum(int(_host_float(r["tokens"])) for r in results)
        if count == 0:
            raise ValueError(f"{API}: the held-out batches hold no counted target (every "
                             "document shorter than 2 tokens, or no batch); hold out more "
                             "text.")
        loss = total / count
        return {f"{self.prefix}loss": loss,
                f"{self.prefix}perplexity": math.exp(min(loss, 700.0)),
                f"{self.prefix}tokens": count}

    def __repr__(self) -> str:
        return f"Evaluation(every={self.every}, step={self.step!r})"
