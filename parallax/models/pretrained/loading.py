"""``px.models.from_pretrained``: a Hugging Face checkpoint straight into a strategy's layout.

The model is built abstractly (``nnx.eval_shape``: no parameter is allocated), each leaf's
sharding is the one ``px.init`` would give it under ``strategy`` on ``mesh``, and each leaf is
created with ``jax.make_array_from_callback``: JAX asks for the part each of this process's
devices holds, and :meth:`Piece.read` reads that part alone from the safetensors file. No
device and no host holds a full copy of a sharded leaf (a replicated leaf is read once per
device that holds it).
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from parallax import layout
from parallax.models.pretrained import families
from parallax.models.pretrained.checkpoint_files import CheckpointFiles
from parallax.models.pretrained.gpt2 import API
from parallax.models.pretrained.pieces import parts_of
from parallax.step.placement import checked_strategy
from parallax.strategy import Strategy


def from_pretrained(path: str | pathlib.Path, *, mesh: Mesh | None = None,
                    strategy: Strategy | None = None, dtype: Any = None,
                    compute_dtype: Any = None, dropout_seed: int = 0,
                    **config_overrides: Any) -> nnx.Module:
    """Loads a Hugging Face checkpoint into the parallax model of its family, sharded.

    The families, by ``config.json``'s ``model_type``: ``gpt2`` (``GPT2LMHeadModel``) into
    ``px.models.GPT``, ``llama`` (``LlamaForCausalLM``) into ``px.models.Llama``, ``qwen2``
    (``Qwen2ForCausalLM``) into a Llama with q/k/v biases and ``mixtral``
    (``MixtralForCausalLM``) into a Llama with MoE blocks (``docs/pretrained.md`` has the name maps and what each refuses). A config field that
    changes what the original computes is refused where the weights would mean something
    else, and named in a ``PretrainedConfigWarning`` where they do not (a dropout the model
    lacks); GPT-2's dropout is turned on as the config asks, and said so.

    Args:
      path: a directory with ``config.json`` and ``model.safetensors`` (or shards with
        ``model.safetensors.index.json``), as ``transformers``' ``save_pretrained`` writes.
      mesh: the device mesh (default: this process's first device alone).
      strategy: the layout (default: replicated over ``mesh``).
      dtype: the parameters' storage dtype (default: the checkpoint's, cast to float32).
      compute_dtype: the dtype the model computes in (its config's ``dtype``; default
        float32), e.g. ``"bfloat16"`` with float32 parameters under ``px.MixedPrecision``.
      dropout_seed: the seed of the model's dropout streams (``nnx.Rngs(dropout=...)``),
        where its config has dropout.
      **config_overrides: fields of the model's config to set (``vocab_pad_multiple``, a
        shorter ``max_seq_len``, ``embed_dropout=0.0``...).

    Returns:
      The model, its parameters already in ``strategy``'s layout on ``mesh``.

    Example:
      >>> import tempfile, jax
      >>> from flax import nnx
      >>> import parallax as px
      >>> d = tempfile.mkdtemp()
      >>> px.models.save_pretrained(d, px.models.GPT(px.models.GPTConfig.tiny(), rngs=nnx.Rngs(0)))
      >>> mesh = px.make_mesh(data=2, fsdp=2, tensor=2)
      >>> strategy = px.compose(px.DataParallel("data"), px.FSDP("fsdp"), px.TensorParallel())
      >>> model = px.models.from_pretrained(d, mesh=mesh, strategy=strategy)
      >>> model.blocks.mlp.fc.kernel.sharding.spec == jax.P(None, "fsdp", "tensor")
      True

    References:
      Hugging Face ``PreTrainedModel.from_pretrained`` and the safetensors format.
    """
    files = CheckpointFiles(path)
    family = families.for_config(files.config, API)
    if dtype is not None:
        config_overrides["param_dtype"] = dtype
    if compute_dtype is not None:
        config_overrides["dtype"] = jnp.dtype(compute_dtype)
    config = family.config_from_hf(files.config, **config_overrides)
    build = lambda: family.MODEL(config, rngs=nnx.Rngs(0, dropout=dropout_seed))  # noqa: E731
    abstract = nnx.eval_shape(build)
    graphdef, shapes, rest_shapes = nnx.split(abstract, nnx.Param, ...)
    shardings, rest_shardings = _shardings(abstract, mesh, strategy)
    top, layers = family.pieces(config, files.names())
    used = set()

    def load(path, leaf, sharding):
        name = layout.dotted_key(path)
        if name in top:
            piece = top[name]
            for part in parts_of(piece):
                used.add(part.name)
                _check_shape(files, part, name, leaf)
            read = lambda index: piece.read(files, index)  # noqa: E731
        elif name in layers[0]:
            per_layer = [layers[i][name] for i in range(len(layers))]
            used.update(part.name for p in per_layer for part in parts_of(p))
            for part in parts_of(per_layer[0]):
                _check_shape(files, part, name, leaf, stacked=len(layers))
            read = lambda index: np.stack(  # noqa: E731
                [per_layer[i].read(files, index[1:]) for i in range(*index[0].indices(len(layers)))])
        else:
            raise ValueError(f"{API}: the model's leaf {name!r} has no tensor in the "
                             f"{family.ARCHITECTURE} checkpoint's name map (a parallax bug).")
        return jax.make_array_from_callback(
            leaf.shape, sharding, lambda index: read(index).astype(leaf.dtype))

    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    loaded = [load(p, leaf, s) for (p, leaf), s in zip(flat, jax.tree.leaves(shardings))]
    unused = [n for n in files.names() if n not in used and not family.ignored(n)]
    if unused:
        raise ValueError(f"{API}: {len(unused)} tensors of {files.path} have no place in "
                         f"parallax's {family.MODEL.__name__}: {', '.join(unused[:5])}; the "
                         "checkpoint is not a plain " + family.ARCHITECTURE + ".")
    files.close()
    # The rest (dropout streams' keys and counters) is made as the constructor makes it;
    # under jit the parameters' initialisers are traced but never computed.
    rest = jax.jit(lambda: nnx.split(build(), nnx.Param, ...)[2],
                   out_shardings=rest_shardings)() if jax.tree.leaves(rest_shapes) else rest_shapes
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, loaded), rest)


def _shardings(abstract, mesh, strategy):
    if mesh is None:
        if strategy is not None:
            raise ValueError(f"{API}: strategy= needs mesh= (px.make_mesh(...)).")
        mesh = Mesh(np.array(jax.local_devices()[:1]), ("data",))
    strategy = checked_strategy(strategy, mesh, API)
    tree = layout.state_shardings(abstract, strategy, mesh, API)
    _, params, rest = nnx.split(tree, nnx.Param, ...)
    named = lambda state: jax.tree.map(  # noqa: E731
        lambda s: s if isinstance(s, NamedSharding) else NamedSharding(mesh, PartitionSpec()),
        state, is_leaf=lambda x: isinstance(x, NamedSharding))
    return named(params), named(rest)


def _check_shape(files, piece, name, leaf, stacked: int = 0) -> None:
    if piece.name not in files.weight_map:
        raise ValueError(f"{API}: tensor {piece.name!r} (for the model's {name}) is missing "
                         f"from {files.path}; the checkpoint is incomplete or not a plain "
                         "model of its config's model_type.")
    stored = files.shape(piece.name)
    rows = piece.rows_stored or (piece.row_dims and int(np.prod(piece.row_dims)))
    cols = piece.cols_stored or int(np.prod(piece.col_dims)) + piece.col_offset
    want = (stored[-1], stored[0]) if piece.transpose else (stored[0], stored[-1] if
                                                             len(stored) > 1 else None)
    ok = (len(stored) == 1 and not piece.row_dims and cols <= stored[0]) or (
        len(stored) == 2 and rows <= want[0] and cols <= want[1])
    if not ok:
        raise ValueError(f"{API}: tensor {piece.name!r} has shape {list(stored)}, which does "
                         f"not hold the model's {name} {list(leaf.shape)} (from config.json's "
                         "sizes); the config and the weights disagree.")
