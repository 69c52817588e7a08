"""Checks of a language model's token input, shared by the GPT and the Llama.

Both embed ``tokens [batch, seq]`` the same way, so both refuse the same two mistakes the
same way: a sequence that the strategy's sequence split does not divide, and concrete ids
outside the vocabulary (which would read a NaN embedding row and give a NaN loss).
"""

from __future__ import annotations

import jax
import numpy as np

from parallax import context
from parallax.mesh import axes_text, axis_size
from parallax.rules import as_tuple


def check_sequence(api: str, seq: int) -> None:
    """Raises when the active strategy splits the sequence into more parts than ``seq`` fills."""
    ctx = context.current()
    if ctx is None:
        return
    axes = [a for a in as_tuple(ctx.strategy.rule_table.get("sequence"))
            if a in ctx.mesh.shape and a not in ctx.manual_axes]
    ways = axis_size(ctx.mesh, axes)
    if seq % ways:
        raise ValueError(
            f"{api}: sequence length {seq} does not split into the {ways} parts of sequence "
            f"parallelism ({axes_text(ctx.mesh, axes)} in {ctx.strategy.name}); use a "
            f"multiple of {ways}, e.g. "
            f"{seq + ways - seq % ways} (next_token_loss takes tokens [batch, length + 1]), "
            "or turn sequence_parallel off."
        )


def check_positions(api: str, tokens, positions) -> None:
    """Refuses per-token ``positions`` (packed documents) not shaped and typed as ``tokens``.

    Example:
      >>> import numpy as np
      >>> check_positions("GPT.embed", np.zeros((1, 3), int), np.arange(3)[None])
    """
    if positions is None:
        return
    if (tuple(positions.shape) != tuple(tokens.shape)
            or not np.issubdtype(np.dtype(positions.dtype), np.integer)):
        raise ValueError(
            f"{api}: positions must be integer positions shaped like the tokens "
            f"{list(tokens.shape)} (each token's position in its packed document), got shape "
            f"{list(positions.shape)} dtype {positions.dtype}; pass the packed batch's "
            "'positions' without the last column, as the tokens.")


def check_token_ids(api: str, tokens, vocab_size: int) -> None:
    """Refuses concrete token ids outside ``[0, vocab_size)``; traced ids pass unchecked.

    An id outside the vocabulary reads no embedding row (``jnp.take`` fills NaN) and has no
    logit, so the loss is NaN with no error. Concrete ids (an eager call, a host batch) are
    checked here, at the cost of reading them. Inside ``jit`` (every ``px.train_step``) the
    ids are abstract and a check would need a host round trip per step:
    ``px.train_step(..., check_finite=True)`` makes that trip and names
    ``GPT.embed: token ids within [0, V)``.

    Args:
      api: the caller, for the message.
      tokens: integer ids (a tracer is not checked).
      vocab_size: V, the number of real (unpadded) ids.

    Raises:
      ValueError: naming the first bad id, its position and the fix.

    Example:
      >>> import numpy as np
      >>> check_token_ids("GPT.embed", np.array([[1, 2]]), 256)  # in range: nothing
    """
    if isinstance(tokens, jax.core.Tracer):
        return
    ids = np.asarray(tokens)
    bad = np.argwhere((ids < 0) | (ids >= vocab_size))
    if bad.size:
        where = tuple(int(i) for i in bad[0])
        raise ValueError(
            f"{api}: token id {int(ids[where])} at tokens{list(where)} is outside the "
            f"vocabulary [0, {vocab_size}) ({len(bad)} such ids); it has no embedding row "
            "and no logit, so the loss would be NaN. Map the ids into the vocabulary, or "
            f"raise GPTConfig.vocab_size to at least {int(ids.max()) + 1}.")
