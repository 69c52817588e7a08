"""Which modules run their matmul in float8, and the hook that switches them.

A dense layer is a module with a ``kernel`` and a ``dot_general`` attribute that it
calls (``nnx.Linear``, ``nnx.LinearGeneral``, ``parallax.nn.Dense``: found by that shape,
since ``strategies/`` sits below ``nn/``), which :class:`Float8Modules` (a ``ModelHooks.before_loss``
entry) replaces on the module ``px.value_and_grad`` rebuilds inside the traced loss. The
user's model is never changed: the rebuilt one lives only in the trace. Stacked
(``nnx.vmap``-created, ``nnx.scan``-run) layers carry the attribute into every layer.

:func:`dense_kernels` lists the same modules' kernels by parameter path, with the number
of leading stacked dimensions of each (what ZeRO 3's float8 gather scales per layer).
"""

from __future__ import annotations

import dataclasses

from flax import nnx

from parallax.strategies.float8.matmul import float8_dot_general
from parallax.strategies.float8.recipe import Float8Recipe

def dotted(path) -> str:
    return ".".join(str(p) for p in path)


def dense_modules(model: nnx.Module, recipe: Float8Recipe):
    """``(dotted path, module)`` of every dense layer the recipe converts."""
    return [(dotted(p), m) for p, m in nnx.iter_modules(model)
            if is_dense(m) and recipe.converts(dotted(p))]


def is_dense(module) -> bool:
    return callable(getattr(module, "dot_general", None)) and \
        isinstance(getattr(module, "kernel", None), nnx.Variable)


def unstacked_kernel_ndim(module) -> int | None:
    """The kernel's rank in one layer (without ``nnx.vmap``'s stacked dimensions), where
    the module says it: ``parallax.nn.Dense`` (``num_in + num_out``), ``nnx.Linear`` (2)."""
    if hasattr(module, "num_in") and hasattr(module, "num_out"):
        return module.num_in + module.num_out
    return 2 if isinstance(module, nnx.Linear) else None


def dense_kernels(model: nnx.Module, recipe: Float8Recipe) -> dict[str, int]:
    """``{kernel path: leading stacked dims}`` of the converted dense layers whose kernel
    rank is known (others are gathered in their own dtype)."""
    return {f"{path}.kernel" if path else "kernel":
            module.kernel[...].ndim - unstacked_kernel_ndim(module)
            for path, module in dense_modules(model, recipe)
            if unstacked_kernel_ndim(module) is not None}


@dataclasses.dataclass(frozen=True)
class Float8Modules:
    """A ``ModelHooks.before_loss`` entry: the converted dense layers' ``dot_general``
    becomes :func:`parallax.strategies.float8.matmul.float8_dot_general`."""

    recipe: Float8Recipe

    def __call__(self, model: nnx.Module) -> None:
        dot = float8_dot_general(self.recipe)
        for _, module in dense_modules(model, self.recipe):
            object.__setattr__(module, "dot_general", dot)
