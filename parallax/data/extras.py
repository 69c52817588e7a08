"""The optional packages under ``parallax.data``, imported where they are used.

``tokenizers`` (Hugging Face's ``tokenizer.json``, BPE training) and ``grain`` (the loader)
come with the ``data`` extra (``pip install 'parallax[data]'``, included in ``dev``), so
``import parallax`` never imports them and a user who feeds their own arrays does not need
them. The byte-level tokenizer and the packing plan need neither.
"""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, api: str) -> ModuleType:
    """``import module``, or an ImportError naming ``api`` and the extra that installs it.

    Example:
      >>> require("numpy", "doc").__name__
      'numpy'
    """
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(
            f"{api} needs the {module!r} package, which parallax installs with its data "
            f"extra: pip install 'parallax[data]' (or pip install {module}).") from error
