"""The model families ``from_pretrained`` reads, by ``config.json``'s ``model_type``."""

from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType

from parallax.models.pretrained import gpt2, llama, mixtral, qwen2

FAMILIES: dict[str, ModuleType] = {"gpt2": gpt2, "llama": llama, "mixtral": mixtral,
                                   "qwen2": qwen2}


def for_config(config: Mapping, api: str) -> ModuleType:
    """The family module of a checkpoint's config.

    Example:
      >>> for_config({"model_type": "gpt2"}, "api").ARCHITECTURE
      'GPT2LMHeadModel'
    """
    kind = config.get("model_type")
    if kind not in FAMILIES:
        raise ValueError(f"{api}: model_type {kind!r} is not supported; parallax reads "
                         f"{', '.join(sorted(FAMILIES))} checkpoints.")
    return FAMILIES[kind]


def for_model(model, api: str) -> ModuleType:
    """The family module of one of our models (a family with ``writes(config)`` takes only
    the configs it says: a Llama with MoE blocks is written as a Mixtral)."""
    for family in FAMILIES.values():
        if isinstance(model, family.MODEL) and getattr(family, "writes", bool)(model.config):
            return family
    models = dict.fromkeys(f.MODEL.__name__ for f in FAMILIES.values())
    raise TypeError(f"{api}: cannot save a {type(model).__name__}; parallax writes "
                    f"{', '.join(models)} models.")
