"""What a loaded ``config.json`` asks for that our model does not do: said, never dropped.

A checkpoint's config can set a field that changes how the original trains or computes
while the weights still fit our model (a dropout rate our Llama lacks, transformers' float32
upcast of GPT-2's attention scores). Loading then goes on, since the weights are right, but
silently it would change a fine-tune's meaning; each such field is named in a
:class:`PretrainedConfigWarning` with what our model does instead and how to silence it.

Example:
  >>> import warnings
  >>> with warnings.catch_warnings(record=True) as caught:
  ...     warnings.simplefilter("always")
  ...     warn_lacking("Llama", {"attention_dropout": 0.1},
  ...                  {"attention_dropout": (0.0, "parallax's Llama has no dropout")})
  >>> print(caught[0].message)  # doctest: +ELLIPSIS
  px.models.from_pretrained: the Llama config asks for attention_dropout=0.1, which ...
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

API = "px.models.from_pretrained"


class PretrainedConfigWarning(UserWarning):
    """A checkpoint's config asks for something the loaded parallax model does not do."""


def warn_lacking(family: str, hf: Mapping, lacking: Mapping[str, tuple[Any, str]]) -> None:
    """Warns once per field of ``hf`` that differs from what our model computes.

    Args:
      family: the checkpoint family's name, as users know it (``"GPT-2"``, ``"Llama"``).
      hf: the checkpoint's ``config.json``.
      lacking: field -> (the value our model matches, what our model does instead). A field
        that is absent or ``None`` is taken as matching.
    """
    for field, (matched, instead) in lacking.items():
        value = hf.get(field)
        if value is None or value == matched:
            continue
        warnings.warn(
            f"{API}: the {family} config asks for {field}={value!r}, which parallax's model "
            f"does not do: {instead}. The weights load as they are; to silence this, set "
            f"{field}={matched!r} in config.json, or filter PretrainedConfigWarning.",
            PretrainedConfigWarning, stacklevel=4)


def say_dropout_on(family: str, rates: Mapping[str, tuple[str, float]]) -> None:
    """Says that a checkpoint's dropout is turned on in the model (``rates``: our field ->
    (their field, rate)), and how to train without it."""
    on = {ours: (theirs, rate) for ours, (theirs, rate) in rates.items() if rate > 0}
    if not on:
        return
    asked = ", ".join(f"{theirs}={rate:g}" for theirs, rate in on.values())
    ours = ", ".join(f"{field}=0.0" for field in on)
    warnings.warn(
        f"{API}: the {family} config asks for dropout ({asked}); the model trains with it "
        f"(GPTConfig {', '.join(f'{f}={r:g}' for f, (_, r) in on.items())}), as transformers' "
        f"model does in train mode. Call model.eval() to evaluate or generate without it, or "
        f"pass {ours} to from_pretrained to fine-tune without dropout.",
        PretrainedConfigWarning, stacklevel=4)
