"""Tensor (Megatron) parallelism as a logical-axis rule table for GSPMD."""

from __future__ import annotations

from parallax.strategy import Strategy


def TensorParallel(axis: str = "tensor", *, sequence_parallel: bool = False) -> Strategy:
    """Shards attention heads, the MLP width and the vocabulary over ``axis``.

    The rule table maps the logical axes ``"heads"``, ``"mlp"`` and ``"vocab"`` to ``axis``;
    ``"embed"`` stays replicated. On a model annotated like ``px.models.GPT`` this is
    Megatron's layout: the query/key/value and MLP input projections are split by columns,
    the attention output and MLP output projections by rows, so each transformer layer needs
    one all-reduce after attention and one after the MLP (XLA inserts them). With
    ``sequence_parallel=True`` the residual stream's ``"sequence"`` axis is also sharded over
    ``axis``, turning those all-reduces into reduce-scatter / all-gather pairs.

    This is the GSPMD form (rules on an unchanged model). The explicit Megatron layers with
    their f/g operators live in ``parallax.nn``.

    Args:
      axis: the mesh axis to shard over.
      sequence_parallel: also shard the sequence of the residual stream (Megatron-3 SP).

    Returns:
      A :class:`parallax.Strategy` holding only rules (it does not split the batch).

    Example:
      >>> import parallax as px
      >>> dict(px.TensorParallel("tensor").rules)["mlp"]
      'tensor'

    References:
      Shoeybi et al., "Megatron-LM", 2019. Korthikanti et al., "Reducing Activation
      Recomputation in Large Transformer Models", 2022 (sequence parallelism).
    """
    rules = [("heads", axis), ("mlp", axis), ("vocab", axis)]
    if sequence_parallel:
        rules.append(("sequence", axis))
    name = f"TensorParallel({axis!r}" + (", sequence_parallel=True)" if sequence_parallel else ")")
    return Strategy(name=name, rules=tuple(rules))
