"""Tensor (Megatron) parallelism: the rule table for GSPMD and its parameter checks.

``TensorParallel(axis)`` maps the logical axes ``"heads"``, ``"mlp"`` and ``"vocab"`` to
``axis``, and grouped-query attention's key/value heads ``"kv_heads"`` too when ``axis``
divides them (a per-array choice, :class:`KeyValueHeads`, as Megatron-LM and transformers'
tensor-parallel plans do; otherwise they are kept whole on every rank). On a model annotated
like ``px.models.GPT`` that is Megatron's layout, and XLA inserts Megatron's collectives: per transformer layer one all-reduce of the ``[B, T, D]``
activations after attention and one after the MLP, and one each in the backward pass; with
``sequence_parallel=True`` each becomes a reduce-scatter plus an all-gather. The explicit
form (``shard_map`` with Megatron's ``f``/``g`` operators) is ``parallax.nn``; see
``docs/tensor_parallel.md``.

This module also holds what both forms share: the divisibility checks with Megatron-specific
fixes (:func:`sharded_dims`, :func:`check_params`). The bytes the Megatron papers say a GPT
step communicates, and the same numbers read from a compiled program, are
:mod:`parallax.analysis.tensor_traffic`.

References:
  Shoeybi et al., "Megatron-LM", 2019. Narayanan et al., "Efficient Large-Scale Language
  Model Training on GPU Clusters Using Megatron-LM", 2021. Korthikanti et al., "Reducing
  Activation Recomputation in Large Transformer Models", 2022 (sequence parallelism).
"""

from __future__ import annotations

import dataclasses

from parallax.rules import annotated_leaves, as_tuple, readable_path
from parallax.strategies.tensor_plan import TensorPlan
from parallax.strategies.tensor_sequence import SequenceLayouts
from parallax.strategy import ModelHooks, Strategy

SPLIT_NAMES = ("heads", "kv_heads", "mlp", "vocab")
_FIXES = {
    "heads": "use a number of attention heads that is a multiple of {n}, or a tensor axis "
             "dividing {size}",
    "mlp": "use an MLP width (mlp_dim) that is a multiple of {n}, or a tensor axis dividing "
           "{size}",
    "vocab": "pad the vocabulary to a multiple of {n}: GPTConfig(vocab_pad_multiple={n}) or "
             "VocabParallelEmbedding(..., pad_to_multiple_of={n}); padded logits are masked, "
             "so the loss is unchanged",
    "kv_heads": "use a number of key/value heads that divides {n} or is a multiple of it",
}


def TensorParallel(axis: str = "tensor", *, sequence_parallel: bool = False,
                   plan: dict | str | None = None) -> Strategy:
    """Shards attention heads, the MLP width and the vocabulary over ``axis``.

    ``"embed"`` stays replicated. The query/key/value and MLP input kernels are split by
    columns, the attention output and MLP output kernels by rows. With
    ``sequence_parallel=True`` the residual stream's ``"sequence"`` axis is sharded over
    ``axis`` too (LayerNorm and residual adds on ``1/T`` of the positions).

    A model annotated with logical names (``nnx.with_partitioning``, like
    ``px.models.GPT``) needs nothing more. A model of stock Flax layers with no annotations
    needs a ``plan`` (:mod:`parallax.strategies.tensor_plan`): module-path patterns to
    ``"colwise"``, ``"rowwise"``, ``"vocab"``, ``"attention"`` or ``"replicate"``, or the
    preset ``"transformer"``. Finding nothing to split over ``axis`` is an error.

    Args:
      axis: the mesh axis to shard over.
      sequence_parallel: also shard the sequence of the residual stream.
      plan: Megatron's styles for the modules of an unannotated NNX model.

    Returns:
      A :class:`parallax.Strategy` holding only rules (it does not split the batch).

    Example:
      >>> import parallax as px
      >>> dict(px.TensorParallel("tensor").rules)["mlp"]
      'tensor'
      >>> px.TensorParallel("tensor", sequence_parallel=True).name
      "TensorParallel('tensor', sequence_parallel=True)"
      >>> px.TensorParallel("tensor", plan={"mlp.up": "colwise", "mlp.down": "rowwise"}).name
      "TensorParallel('tensor', plan={'mlp.up': 'colwise', 'mlp.down': 'rowwise'})"

    References:
      Shoeybi et al., "Megatron-LM", 2019. Korthikanti et al., 2022 (sequence parallelism).
      Liang et al., "TorchTitan", 2024 (plans as data).
    """
    rules = [(name, axis) for name in SPLIT_NAMES]
    if sequence_parallel:
        rules.append(("sequence", axis))
    plans = (TensorPlan.of(plan, axis),) if plan is not None else ()
    sequence = tuple(SequenceLayouts(p, axis) for p in plans) if sequence_parallel else ()
    extra = (", sequence_parallel=True" if sequence_parallel else "") + (
        f", plan={plan!r}" if plan is not None else "")
    hooks = ModelHooks(param_checks=(MegatronCheck(axis),), param_names=plans,
                       layout_checks=(SplitsSomething(axis),), before_loss=sequence,
                       name_choices=(KeyValueHeads(axis),))
    return Strategy(name=f"TensorParallel({axis!r}{extra})", rules=tuple(rules),
                    model_hooks=hooks)


@dataclasses.dataclass(frozen=True)
class SplitsSomething:
    """``TensorParallel``'s layout check: an NNX model must have something split over its axis.

    Without it, a model of stock layers under ``TensorParallel`` replicates every parameter
    with no error, no warning and no collective on the tensor axis. A plain parameter tree
    (no module) is left as it is: ``TensorParallel``'s rules may be there for activations
    only, and such a tree has no layers a plan could name.
    """

    axis: str

    def __call__(self, layouts, mesh, *, api: str = "px.TensorParallel", prefix: tuple = (),
                 model=None):
        if model is None or not layouts:
            return
        if self.axis not in mesh.shape or mesh.shape[self.axis] == 1:
            return
        if any(self.axis in as_tuple(e) for lay in layouts for e in lay.base):
            return
        paths = [readable_path(prefix + lay.path) for lay in layouts]
        raise ValueError(
            f"{api}: TensorParallel({self.axis!r}) finds nothing to split over the mesh axis "
            f"{self.axis}={mesh.shape[self.axis]}: no parameter is named 'heads', 'mlp' or "
            f"'vocab'. The model's parameters are {paths[:8]}{' ...' if len(paths) > 8 else ''}."
            " Fix: annotate them (nnx.with_partitioning(init, ('embed', 'mlp'))), or give "
            "a plan: px.TensorParallel(axis, plan={'blocks.*.mlp.up': 'colwise', "
            "'blocks.*.mlp.down': 'rowwise', ...}) or plan='transformer'.")


@dataclasses.dataclass(frozen=True)
class MegatronCheck:
    """``TensorParallel``'s parameter check (a ``ModelHooks.param_checks`` entry).

    ``px.init``, ``px.shard`` and ``px.train_step`` call it on every annotated parameter, so
    a head count, MLP width or vocabulary that does not split over the tensor axis fails
    with Megatron's fix (e.g. ``GPTConfig(vocab_pad_multiple=...)``) rather than the
    generic layout message. A value, so that equal strategies compare equal.
    """

    axis: str

    def __call__(self, names, shape, mesh, *, path: tuple = (), api: str = "px.TensorParallel"):
        # Key/value heads ("kv_heads") split only where the tensor size divides them
        # (KeyValueHeads) and are kept whole elsewhere, which GSPMD computes for any count:
        # not checked here. The explicit layers, which need a rank's query heads to read
        # whole key/value heads, check them (px.nn.param_specs, sharded_dims).
        names = tuple(None if n == "kv_heads" else n for n in names)
        if self.axis in mesh.shape:
            sharded_dims(names, shape, self.axis, mesh.shape[self.axis],
                         path=readable_path(path), api=api)


@dataclasses.dataclass(frozen=True)
class KeyValueHeads:
    """``TensorParallel``'s choice for grouped-query attention (a ``ModelHooks.name_choices``
    entry): key/value heads (``"kv_heads"``) split over the tensor axis when its size
    divides them, kept whole (replicated) when it does not.

    Split, each rank's query heads read exactly its own key/value heads, so attention needs
    no communication and each rank holds ``1/T`` of the K/V parameters and activations. With
    fewer heads than ranks (``T`` a multiple of ``G``) every rank keeps all of them. The rule
    must see the sizes, which a rule table cannot, so it is a per-array choice that
    ``px.init`` (parameters) and ``px.constrain`` (activations) apply before the rules.

    Example:
      >>> import parallax as px
      >>> choose = KeyValueHeads("tensor")
      >>> choose(("embed", "kv_heads", "kv"), (64, 8, 16), px.make_mesh(tensor=4, data=-1))
      ('embed', 'kv_heads', 'kv')
      >>> choose(("embed", "kv_heads", "kv"), (64, 2, 16), px.make_mesh(tensor=4, data=-1))
      ('embed', None, 'kv')

    References:
      Ainslie et al., "GQA", 2023; Megatron-LM (``num_query_groups`` split over the tensor
      ranks); Hugging Face transformers' tensor-parallel plans.
    """

    axis: str

    def __call__(self, names, shape, mesh):
        size = mesh.shape.get(self.axis, 1)
        if "kv_heads" not in names or size == 1:
            return names
        return tuple(None if name == "kv_heads" and length % size else name
                     for name, length in zip(names, shape))


def sharded_dims(names, shape, axis: str, size: int, rules=None, *, path: str = "",
                 api: str = "px.TensorParallel") -> tuple[bool, ...]:
    """Which dimensions of one parameter are split over ``axis`` (``size`` ranks).

    A dimension is split when ``rules`` maps its logical name to ``axis``. Key/value heads
    of grouped-query attention (``"kv_heads"``) are split when they divide by ``size`` and
    replicated when there are fewer (``size`` a multiple of them).

    Raises:
      ValueError: a split dimension does not divide by ``size``; the message names the
        API, the path, the shape, the mesh axis and size, and a fix for heads, MLP width
        and vocabulary (padding).
    """
    rules = dict(TensorParallel(axis).rules) if rules is None else rules
    out = []
    for dim, (name, length) in enumerate(zip(names or (None,) * len(shape), shape)):
        split = name is not None and axis in as_tuple(rules.get(name))
        if name == "kv_heads":  # grouped-query attention: split, or replicate when fewer
            split = length % size == 0 or size % length != 0
        if split and length % size:
            fix = _FIXES.get(name, "pad that dimension to a multiple of {n}").format(
                n=size, size=length)
            raise ValueError(
                f"{api}: {path or 'a parameter'} has shape {tuple(shape)}: its {name!r} "
                f"dimension {dim} has {length} entries, which do not split over the tensor "
                f"axis {axis}={size}. Fix: {fix}."
            )
        out.append(split)
    return tuple(out)


def check_params(params, mesh, axis: str = "tensor", *, rules=None,
                 api: str = "px.TensorParallel") -> None:
    """Checks every annotated parameter of ``params`` against ``axis`` of ``mesh``.

    Example:
      >>> import parallax as px
      >>> from flax import nnx
      >>> model = nnx.eval_shape(lambda: px.models.GPT(
      ...     px.models.GPTConfig.tiny(num_heads=2, embed_dim=32), rngs=nnx.Rngs(0)))
      >>> px.strategies.tensor.check_params(nnx.state(model), px.make_mesh(tensor=-1))
      Traceback (most recent call last):
      ...
      ValueError: px.TensorParallel: ['blocks']['attn']['out']['kernel'] has shape (2, 2, 16, 32): its 'heads' dimension 1 has 2 entries, which do not split over the tensor axis tensor=8. Fix: use a number of attention heads that is a multiple of 8, or a tensor axis dividing 2.
    """
    size = mesh.shape[axis]
    for leaf in annotated_leaves(params):
        if leaf.names is not None and not leaf.physical:
            sharded_dims(leaf.names, leaf.leaf.shape, axis, size, rules,
                         path=readable_path(leaf.path), api=api)
