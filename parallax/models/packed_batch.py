"""A language model's batch, plain or packed: inputs, targets, and which targets count.

A plain batch is ``{"tokens": int [B, T + 1]}``: inputs ``tokens[:, :-1]``, targets
``tokens[:, 1:]``, every target counted. A packed batch (``parallax.data``'s rows: several
documents per row) adds

- ``"segment_ids"`` int ``[B, T + 1]``: the document of each token, ``1, 2, ...`` within a
  row, ``0`` for padding;
- ``"positions"`` int ``[B, T + 1]``: each token's position in its own document.

The model then attends within documents only and reads the per-document positions
(``GPT`` / ``Llama`` take them as ``segment_ids=`` / ``positions=``). A target counts when
it belongs to the same document as its input token and is not padding: the label of a
document's last token is the next document's first token, which the model cannot know.

How the loss's mean is taken: over all ``B * T`` positions, the positions whose target does
not count contributing zero (:func:`target_weights`). The denominator is then the same on
every shard of a batch, so the mean of equal shards' losses is still the whole batch's
(what data parallelism and micro-batching rely on, and why a parallel run equals one
device); a mean over counted targets only would differ per shard. The loss is therefore
the per-token mean times the fraction of targets that count (packing's boundaries and
padding); held-out evaluation (``px.metrics.Evaluation``) divides by the counted targets
instead, for the true per-token loss and perplexity.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

PACKED_KEYS = ("segment_ids", "positions")


def _checked(api: str, batch: Mapping[str, jax.Array], key: str, shape) -> jax.Array | None:
    value = batch.get(key)
    if value is None:
        return None
    if tuple(value.shape) != tuple(shape) or not jnp.issubdtype(value.dtype, jnp.integer):
        raise ValueError(
            f"{api}: batch[{key!r}] must be integer ids shaped like batch['tokens'] "
            f"{list(shape)} (one per token, [batch, seq + 1]), got shape "
            f"{list(value.shape)} dtype {value.dtype}. Pass the packed rows as parallax.data "
            "makes them, or leave the key out for one document per row.")
    return value


def split_batch(api: str, batch: Mapping[str, jax.Array]):
    """``(inputs [B, T], targets [B, T], model keyword arguments, target weights or None)``.

    The keyword arguments are ``segment_ids`` and ``positions`` (without the last column)
    when the batch has them; the weights are :func:`target_weights` when it has segment ids.

    Example:
      >>> import jax.numpy as jnp
      >>> batch = {"tokens": jnp.array([[5, 6, 7, 8]]), "segment_ids": jnp.array([[1, 1, 2, 2]]),
      ...          "positions": jnp.array([[0, 1, 0, 1]])}
      >>> inputs, targets, kwargs, weights = split_batch("doc", batch)
      >>> inputs.tolist(), sorted(kwargs), weights.tolist()
      ([[5, 6, 7]], ['positions', 'segment_ids'], [[1.0, 0.0, 1.0]])
    """
    tokens = batch["tokens"]
    if tokens.ndim != 2 or tokens.shape[1] < 2:
        raise ValueError(
            f"{api}: batch['tokens'] must have shape [batch, seq + 1] with seq >= 1, got "
            f"{list(tokens.shape)}.")
    segments = _checked(api, batch, "segment_ids", tokens.shape)
    positions = _checked(api, batch, "positions", tokens.shape)
    kwargs = {}
    if segments is not None:
        kwargs["segment_ids"] = segments[:, :-1]
    if positions is not None:
        kwargs["positions"] = positions[:, :-1]
    weights = None if segments is None else target_weights(segments)
    return tokens[:, :-1], tokens[:, 1:], kwargs, weights


def target_weights(segment_ids: jax.Array) -> jax.Array:
    """float32 ``[B, T]``: 1 where the target ``t + 1`` is in the input ``t``'s document
    (not padding), else 0.

    Example:
      >>> import jax.numpy as jnp
      >>> target_weights(jnp.array([[1, 1, 1, 2, 2, 0]])).tolist()
      [[1.0, 1.0, 0.0, 1.0, 0.0]]
    """
    same = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] != 0)
    return same.astype(jnp.float32)


def counted_targets(batch: Mapping[str, jax.Array]) -> jax.Array:
    """How many targets of ``batch`` its loss counts: ``B * T`` for a plain batch, the sum
    of :func:`target_weights` for a packed one (an int32 scalar).

    Example:
      >>> import jax.numpy as jnp
      >>> int(counted_targets({"tokens": jnp.zeros((2, 5), jnp.int32)}))
      8
    """
    tokens = batch["tokens"]
    segments = batch.get("segment_ids")
    if segments is None:
        return jnp.asarray(tokens.shape[0] * (tokens.shape[1] - 1), jnp.int32)
    return jnp.sum(target_weights(jnp.asarray(segments))).astype(jnp.int32)


def refuse_packed(api: str, batch: Mapping[str, jax.Array], where: str) -> None:
    """Raises when ``batch`` is packed (segment ids or positions) where they are not
    carried (``where``), rather than silently attending across documents."""
    found = [key for key in PACKED_KEYS if key in batch]
    if found:
        raise ValueError(
            f"{api}: the batch has {found} (packed documents), which {where} does not carry "
            "to the attention yet; train packed batches without a pipeline, or pack one "
            "document per row and leave the keys out.")
