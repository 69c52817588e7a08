"""Pretrained weights in Hugging Face's format: ``from_pretrained`` into any layout, and back."""

from parallax.models.pretrained.loading import from_pretrained as from_pretrained
from parallax.models.pretrained.saving import save_pretrained as save_pretrained

__all__ = ["from_pretrained", "save_pretrained"]
