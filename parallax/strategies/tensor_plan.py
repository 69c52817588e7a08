"""Tensor-parallel plans: module paths to Megatron's styles, for models without annotations.

A model written with stock Flax layers names no logical axes, so ``TensorParallel``'s rules
find nothing to split. A plan says, as data, what each module is in Megatron's layout
(torchtitan's ``parallelize_module`` plans, in JAX's terms)::

    plan = {
        "blocks.*.attn": "attention",   # nnx.MultiHeadAttention: heads split, output row-parallel
        "blocks.*.mlp.up": "colwise",   # nnx.Linear / LinearGeneral / Einsum: output features split
        "blocks.*.mlp.down": "rowwise", # input features split; XLA all-reduces the output
        "embed": "vocab",               # nnx.Embed: rows (the vocabulary) split
        "head": "vocab",                # an output projection over the vocabulary
        "blocks.*.norm*": "sequence",    # replicated; sequence shards with sequence_parallel
    }

Keys are ``fnmatch`` patterns over a module's dotted path (``blocks.0.mlp.up``); entries are
tried in order and the first that matches a module decides its style. The plan turns into
logical names for the module's parameters (``"heads"``, ``"mlp"``, ``"vocab"``), which
``TensorParallel``'s rules map to the tensor axis, so everything downstream (ZeRO's choice
of dimension, the layout checks, the GSPMD collectives) is the same as for an annotated
model. ``"transformer"`` is a preset that reads the structure instead of the names (see
:func:`transformer_plan`).

An entry that matches no module is an error, naming the mesh axis, the model's module
paths and the fix; so is a style that does not apply to the module it matched.

References:
  Shoeybi et al., "Megatron-LM", 2019 (column- and row-parallel linear layers, parallel
  attention, vocabulary-parallel embedding). Liang et al., "TorchTitan", 2024
  (tensor-parallel plans as data).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Mapping

from flax import nnx

STYLES = ("colwise", "rowwise", "vocab", "replicate", "attention", "sequence")
LINEARS = (nnx.Linear, nnx.LinearGeneral, nnx.Einsum)
_APPLIES = {
    "colwise": "nnx.Linear, nnx.LinearGeneral, nnx.Einsum",
    "rowwise": "nnx.Linear, nnx.LinearGeneral, nnx.Einsum",
    "vocab": "nnx.Embed, or an output projection (nnx.Linear, nnx.LinearGeneral, nnx.Einsum)",
    "attention": "nnx.MultiHeadAttention",
    "replicate": "any module",
    "sequence": "any module (norms, dropout: sequence shards under sequence parallelism)",
}
PRESETS = ("transformer",)
Names = tuple


def dotted(path) -> str:
    return ".".join(str(p) for p in path)


def _linear_dims(module) -> tuple[list[int], list[int]]:
    """(contracted kernel dims, output kernel dims) of a linear module's kernel."""
    ndim = module.kernel.ndim
    if isinstance(module, nnx.Einsum):
        spec = module.einsum_str.replace(" ", "")
        inputs, output = spec.split("->")
        lhs, kernel = inputs.split(",")
        kernel = kernel.replace("...", "")
        contracted = [d for d, c in enumerate(kernel) if c in lhs and c not in output]
        out = [d for d, c in enumerate(kernel) if c in output and c not in lhs]
        return contracted, out
    if isinstance(module, nnx.LinearGeneral):
        n_in = len(module.in_features) if isinstance(module.in_features, tuple) else 1
        n_out = len(module.out_features) if isinstance(module.out_features, tuple) else 1
        extra = ndim - n_in - n_out  # batch_axis dims come first
        return list(range(extra, extra + n_in)), list(range(extra + n_in, ndim))
    return [ndim - 2], [ndim - 1]  # nnx.Linear (leading dims: a stack of layers)


def _bias_names(module, kernel_dim: int, name: str, ndim_bias: int) -> Names:
    """The bias follows the kernel's split output dimension (its trailing dimensions)."""
    if isinstance(module, nnx.Einsum):
        output = module.einsum_str.replace(" ", "").split("->")[1].replace("...", "")
        kernel = module.einsum_str.replace(" ", "").split("->")[0].split(",")[1]
        letter = kernel.replace("...", "")[kernel_dim]
        trailing = output[len(output) - ndim_bias:]
        return tuple(name if c == letter else None for c in trailing)
    _, out = _linear_dims(module)
    offset = kernel_dim - out[0]
    names = [None] * ndim_bias
    lead = ndim_bias - len(out)
    if 0 <= lead + offset < ndim_bias:
        names[lead + offset] = name
    return tuple(names)


def style_names(module, style: str, path: str, api: str) -> dict[str, Names]:
    """``{variable name: logical names}`` for one module under ``style``."""
    if style in ("replicate", "sequence"):
        return {}
    if style == "attention":
        if not isinstance(module, nnx.MultiHeadAttention):
            raise _wrong_type(module, style, path, api)
        kv = "heads" if module.num_kv_heads in (None, module.num_heads) else "kv_heads"
        out = {}
        for part, heads in (("query", "heads"), ("key", kv), ("value", kv)):
            for var, names in style_names(getattr(module, part), "colwise", path, api).items():
                out[f"{part}.{var}"] = tuple(heads if n else None for n in names)
        for var, names in style_names(module.out, "rowwise", path, api).items():
            out[f"out.{var}"] = tuple("heads" if n else None for n in names)
        return out
    if style == "vocab" and isinstance(module, nnx.Embed):
        return {"embedding": (None,) * (module.embedding.ndim - 2) + ("vocab", None)}
    if not isinstance(module, LINEARS):
        raise _wrong_type(module, style, path, api)
    name = "vocab" if style == "vocab" else "mlp"
    contracted, out = _linear_dims(module)
    split = out[0] if style in ("colwise", "vocab") else contracted[0]
    names = {"kernel": tuple(name if d == split else None for d in range(module.kernel.ndim))}
    bias = getattr(module, "bias", None)
    if bias is not None and style != "rowwise":
        names["bias"] = _bias_names(module, split, name, bias.ndim)
    return names


def _kind(module) -> str:
    cls = type(module)
    return f"nnx.{cls.__name__}" if cls.__module__.startswith("flax.nnx") else (
        f"{cls.__module__}.{cls.__name__}")


def _wrong_type(module, style, path, api) -> ValueError:
    return ValueError(
        f"{api}: the plan gives {path or '(the model)'} the style {style!r}, but it is an "
        f"{_kind(module)}; {style!r} applies to {_APPLIES[style]}. Give it 'replicate', or "
        "point the entry at its layers.")


@dataclasses.dataclass(frozen=True)
class TensorPlan:
    """A tensor-parallel plan: ``(pattern, style)`` entries, or a named preset.

    Attributes:
      axis: the tensor mesh axis (for messages).
      entries: ``(fnmatch pattern over dotted module paths, style)``, tried in order.
      preset: ``"transformer"`` instead of entries (see :func:`transformer_plan`).

    Example:
      >>> from flax import nnx
      >>> mlp = nnx.Sequential(nnx.Linear(4, 16, rngs=nnx.Rngs(0)),
      ...                      nnx.Linear(16, 4, rngs=nnx.Rngs(0)))
      >>> plan = TensorPlan.of({"layers.0": "colwise", "layers.1": "rowwise"}, "tensor")
      >>> plan(mlp)
      {'layers.0.kernel': (None, 'mlp'), 'layers.0.bias': ('mlp',), 'layers.1.kernel': ('mlp', None)}
    """

    axis: str
    entries: tuple[tuple[str, str], ...] = ()
    preset: str | None = None

    @classmethod
    def of(cls, plan, axis: str, api: str = "px.TensorParallel") -> TensorPlan:
        if isinstance(plan, str):
            if plan not in PRESETS:
                raise ValueError(f"{api}: plan={plan!r} is not a preset ({PRESETS}); pass a "
                                 "dict of module-path patterns to styles.")
            return cls(axis, (), plan)
        if not isinstance(plan, Mapping) or not plan:
            raise TypeError(
                f"{api}: plan must be a non-empty dict of module-path patterns to styles "
                f"{STYLES} (e.g. {{'blocks.*.mlp.up': 'colwise'}}) or 'transformer'; got "
                f"{type(plan).__name__}: {plan!r}.")
        for pattern, style in plan.items():
            if not isinstance(pattern, str) or style not in STYLES:
                raise ValueError(f"{api}: plan entry {pattern!r}: {style!r} must map a "
                                 f"string pattern to one of {STYLES}.")
        return cls(axis, tuple(plan.items()))

    def styles(self, model: nnx.Module, api: str) -> dict[str, tuple[str, object]]:
        """``{dotted path: (style, module)}`` of every module the plan gives a style."""
        modules = [(dotted(p), m) for p, m in nnx.iter_modules(model)]
        if self.preset is not None:
            return transformer_plan(modules)
        found, used = {}, set()
        for path, module in modules:
            for i, (pattern, style) in enumerate(self.entries):
                if fnmatch.fnmatchcase(path, pattern):
                    found[path] = (style, module)
                    used.add(i)
                    break
        unused = [p for i, (p, _) in enumerate(self.entries) if i not in used]
        if unused:
            paths = sorted(p for p, _ in modules if p)
            raise ValueError(
                f"{api}: the tensor-parallel plan for mesh axis {self.axis!r} has entries "
                f"that match no module: {unused}. The model's modules are {paths[:12]}"
                f"{' ...' if len(paths) > 12 else ''}. Fix the patterns (fnmatch over dotted "
                "paths, e.g. 'blocks.*.mlp.up').")
        return found

    def __call__(self, model, api: str = "px.TensorParallel") -> dict[str, Names]:
        """``{dotted parameter path: logical names}`` (a ``ModelHooks.param_names`` source)."""
        if model is None:
            raise TypeError(
                f"{api}: a tensor-parallel plan reads the model's layers, so it needs an "
                "NNX model: a px.TrainState, or the nnx.Module itself; a plain parameter "
                "tree has no layers. Annotate the tree's leaves instead (Linen "
                "nn.with_logical_partitioning, or nnx.with_partitioning).")
        return self.names(model, api)

    def names(self, model: nnx.Module, api: str = "px.TensorParallel") -> dict[str, Names]:
        """``{dotted parameter path: logical names}`` for the model's parameters."""
        out = {}
        for path, (style, module) in self.styles(model, api).items():
            for var, names in style_names(module, style, path, api).items():
                out[f"{path}.{var}" if path else var] = names
        return out


def _mlp_pairs(modules) -> dict[str, str]:
    """Inside each module, two ``nnx.Linear`` D -> F and F -> D (an MLP): colwise, rowwise.

    The up-projection is the one that reads the model width D (an embedding's or a
    LayerNorm's feature count); without one, the one with fewer inputs (it expands).
    """
    widths = {m.features for _, m in modules if isinstance(m, nnx.Embed)}
    widths |= {m.num_features for _, m in modules if isinstance(m, nnx.LayerNorm)}
    styles = {}
    for path, module in modules:
        children = [(f"{path}.{n}" if path else n, m) for n, m in vars(module).items()
                    if isinstance(m, nnx.Linear)]
        for i, (pa, a) in enumerate(children):
            for pb, b in children[i + 1:]:
                if a.out_features != b.in_features or a.in_features != b.out_features:
                    continue
                a_up = (a.in_features in widths) != (b.in_features in widths)
                up_first = a.in_features in widths if a_up else a.in_features < b.in_features
                (up, down) = (pa, pb) if up_first else (pb, pa)
                styles.setdefault(up, "colwise")
                styles.setdefault(down, "rowwise")
    return styles


def transformer_plan(modules) -> dict[str, tuple[str, object]]:
    """The preset for standard NNX transformer blocks, read from the structure.

    Every ``nnx.MultiHeadAttention`` gets ``"attention"``; every ``nnx.Embed``
    ``"vocab"``; inside any module, an ``nnx.Linear`` from D to F followed by one from F
    back to D (an MLP) ``"colwise"`` then ``"rowwise"``; an ``nnx.Linear`` whose output size
    is an embedding's vocabulary ``"vocab"`` (the output head); norms and dropout
    ``"sequence"`` (sequence shards under sequence parallelism). Everything else stays
    replicated. Names do not matter, so it fits any model built from those layers.
    """
    vocab = {m.num_embeddings for _, m in modules if isinstance(m, nnx.Embed)}
    mlps = _mlp_pairs(modules)
    found = {}
    inside_attention = [p for p, m in modules if isinstance(m, nnx.MultiHeadAttention)]
    for path, module in modules:
        if any(path.startswith(a + ".") for a in inside_attention):
            continue
        if isinstance(module, nnx.MultiHeadAttention):
            found[path] = ("attention", module)
        elif isinstance(module, nnx.Embed):
            found[path] = ("vocab", module)
        elif path in mlps:
            found[path] = (mlps[path], module)
        elif isinstance(module, nnx.Linear) and module.out_features in vocab:
            found[path] = ("vocab", module)
        elif isinstance(module, (nnx.LayerNorm, nnx.RMSNorm, nnx.Dropout)):
            found[path] = ("sequence", module)
    return found
