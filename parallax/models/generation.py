"""``px.models.generate``: text from a GPT or a Llama, with a key/value cache.

One compiled program: the prompt goes through the model once (filling the cache), then a
``lax.fori_loop`` feeds back one token at a time, each step reading the cache instead of the
prefix. On one device it is a plain ``jax.jit``; given the training ``mesh`` and ``strategy``
it runs as a ``px.eval_step`` of that layout, so the weights stay sharded where training keeps
them (data, FSDP and tensor axes: the prompt's rows split over the batch axes, heads over the
tensor axis) and nothing is gathered onto one device.

What is not here yet: prompts of different lengths in one batch (no padding mask: rows share
one length), stopping at an end-of-sequence id, beam search, the MoE GPT, and strategies that
split the sequence (context or sequence parallelism) or the layers (pipelines), which are
refused with a message.

References:
  Hugging Face transformers ``GenerationMixin.generate`` (greedy and sampling; the warpers in
  :mod:`parallax.models.sampling`); Pope et al., "Efficiently Scaling Transformer
  Inference", 2022 (the KV cache).
"""

from __future__ import annotations

import numbers
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from parallax.mesh import axes_text, axis_size, describe
from parallax.models.cached_forward import FAMILIES, forward_with_cache, new_cache
from parallax.models.sampling import next_token
from parallax.step import eval_step

API = "px.models.generate"


def _decode(model, prompt, max_new_tokens, settings, seed):
    batch, prompt_len = prompt.shape
    total = prompt_len + max_new_tokens
    key = jax.random.key(seed)
    logits, cache = forward_with_cache(model, prompt, new_cache(model, batch, total))
    tokens = jnp.zeros((batch, total), jnp.int32).at[:, :prompt_len].set(prompt)
    tokens = tokens.at[:, prompt_len].set(next_token(logits, jax.random.fold_in(key, 0),
                                                     *settings))

    # The weights travel in the loop's carry (unchanged): nnx rebuilds the model at the
    # body's trace level, where the blocks' scan may read it.
    graph, weights = nnx.split(model)

    def step(i, carry):
        tokens, cache, weights = carry
        model = nnx.merge(graph, weights)
        last = jax.lax.dynamic_slice_in_dim(tokens, prompt_len + i - 1, 1, axis=1)
        logits, cache = forward_with_cache(model, last, cache)
        chosen = next_token(logits, jax.random.fold_in(key, i), *settings)
        tokens = jax.lax.dynamic_update_slice_in_dim(tokens, chosen[:, None],
                                                     prompt_len + i, axis=1)
        return tokens, cache, weights

    return jax.lax.fori_loop(1, max_new_tokens, step, (tokens, cache, weights))[0]


_decode_jitted = jax.jit(_decode, static_argnums=(2, 3))


def _check_number(name, value, kinds, rule, fix):
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise TypeError(f"{API}: {name} must be {rule}, got {type(value).__name__} {value!r}; "
                        f"{fix}.")


def _checked(model, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed):
    """The validated ``(prompt int32 [B, P], settings)``; every message names the rule and
    a fix."""
    if not isinstance(model, FAMILIES) or getattr(model.config, "moe", None) is not None:
        raise TypeError(f"{API}: model must be a px.models.GPT (without MoE) or a "
                        f"px.models.Llama, got {type(model).__name__}; load one with "
                        "px.models.from_pretrained or build it from a GPTConfig/LlamaConfig.")
    dtype = getattr(prompt_ids, "dtype", None)
    if dtype is None:
        prompt_ids = np.asarray(prompt_ids)
        dtype = prompt_ids.dtype
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"{API}: prompt_ids must be integer token ids [batch, prompt], got "
                        f"dtype {dtype}; tokenize the text (px.data tokenizers) or cast with "
                        ".astype(np.int32).")
    shape = tuple(prompt_ids.shape)
    if len(shape) != 2 or shape[1] == 0 or shape[0] == 0:
        raise ValueError(f"{API}: prompt_ids must be [batch, prompt] with at least one row "
                         f"and one token, got shape {list(shape)}; a single prompt is "
                         "ids[None, :].")
    _check_number("max_new_tokens", max_new_tokens, numbers.Integral, "a positive int",
                  "e.g. max_new_tokens=32")
    c = model.config
    if max_new_tokens < 1 or shape[1] + max_new_tokens > c.max_seq_len:
        raise ValueError(
            f"{API}: the prompt ({shape[1]} tokens) plus max_new_tokens={max_new_tokens} must "
            f"be between {shape[1] + 1} and the model's max_seq_len={c.max_seq_len} "
            f"({type(model).__name__}'s positions); shorten the prompt or ask for fewer "
            "tokens.")
    try:
        ids = np.asarray(prompt_ids)
    except jax.errors.TracerArrayConversionError:  # inside a jit: shapes only
        ids = None
    if ids is not None:
        if ids.min() < 0 or ids.max() >= c.vocab_size:
            raise ValueError(f"{API}: prompt_ids must lie in [0, {c.vocab_size}) (the model's "
                             f"vocab_size), got ids from {ids.min()} to {ids.max()}; use the "
                             "checkpoint's own tokenizer.")
    _check_number("temperature", temperature, numbers.Real, "a float >= 0",
                  "0.0 is greedy, 1.0 samples from the model's distribution")
    if not temperature >= 0 or not np.isfinite(temperature):
        raise ValueError(f"{API}: temperature must be a finite float >= 0 (0 is greedy), got "
                         f"{temperature}.")
    if top_k is not None:
        _check_number("top_k", top_k, numbers.Integral, "None or an int >= 0", "e.g. top_k=50")
        if top_k < 0:
            raise ValueError(f"{API}: top_k must be >= 0 (0 or None: off), got {top_k}.")
    if top_p is not None:
        _check_number("top_p", top_p, numbers.Real, "None or a float in [0, 1]", "e.g. 0.9")
        if not 0.0 <= top_p <= 1.0:
            raise ValueError(f"{API}: top_p must be a float in [0, 1] (1.0 or None: off), got "
                             f"{top_p}; e.g. top_p=0.9 keeps the most likely tokens that "
                             "cover 90% of the probability.")
    _check_number("seed", seed, numbers.Integral, "an int", "e.g. seed=0")
    if temperature == 0 and (top_k or (top_p is not None and top_p < 1.0)):
        # transformers warns and ignores them under do_sample=False (GenerationConfig.validate)
        warnings.warn(f"{API}: temperature=0 decodes greedily; top_k={top_k} and "
                      f"top_p={top_p} apply only when sampling (temperature > 0).",
                      UserWarning, stacklevel=3)
    settings = (float(temperature), int(top_k) if top_k else None,
                None if top_p is None or top_p >= 1.0 else float(top_p))
    return jnp.asarray(prompt_ids, jnp.int32), settings


def _check_layout(mesh, strategy, batch: int) -> None:
    split = {name: axes for name, axes in strategy.rules if name in ("layers", "sequence")
             and axes}
    if strategy.sequence_split is not None or split:
        what = ("the sequence (context parallelism)" if strategy.sequence_split is not None
                else " and ".join(f"{n!r} over {a}" for n, a in split.items()))
        raise ValueError(f"{API}: strategy {strategy.name} splits {what}; decoding feeds one "
                         "token at a time and runs the layers in one program, so generate "
                         "takes data, FSDP/ZeRO and tensor layouts. Pass a strategy without "
                         "it (the weights restored under it: px.models.from_pretrained or "
                         "px.checkpoint with that strategy).")
    ways = axis_size(mesh, strategy.batch_axes)
    if jax.process_count() == 1 and batch % ways:  # several processes: eval_step's check
        raise ValueError(f"{API}: the prompt's {batch} rows do not divide over the batch axes "
                         f"{axes_text(mesh, strategy.batch_axes)} ({ways} ways) of mesh "
                         f"{describe(mesh)}; pass a multiple of {ways} prompts (repeat one).")


def generate(model, prompt_ids, max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, seed: int = 0,
             mesh=None, strategy=None) -> jax.Array:
    """Continues each prompt by ``max_new_tokens`` tokens, with a key/value cache.

    Args:
      model: a ``px.models.GPT`` or ``px.models.Llama`` (trained, or loaded with
        ``px.models.from_pretrained``), on one device or sharded by ``px.init`` /
        ``from_pretrained(mesh=, strategy=)``.
      prompt_ids: int ``[B, P]`` token ids, every row P long (no padding).
      max_new_tokens: how many tokens to add; ``P + max_new_tokens <= config.max_seq_len``.
      temperature: 0 is greedy (transformers' ``do_sample=False``); above 0, the logits are
        divided by it and the next token drawn (transformers' ``do_sample=True``).
      top_k: keep the k most likely tokens (0 or None: all), as transformers' warper.
      top_p: keep the most likely tokens whose probability covers ``top_p`` (1.0 or None:
        all), as transformers' warper (:mod:`parallax.models.sampling`).
      seed: the random draws' seed (step i draws with ``fold_in(key(seed), i)``): the same
        seed gives the same text on one device and on any mesh.
      mesh, strategy: the training layout to run in (``px.eval_step``'s); both or neither.
        The program is compiled again for each call in a layout (one device: once per
        shape and settings). Tested in one process; across processes each would pass its
        own rows, as to an eval step, untested.

    Returns:
      int32 ``[B, P + max_new_tokens]``: the prompt followed by the new tokens.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import parallax as px
      >>> model = px.models.GPT(px.models.GPTConfig.tiny(), rngs=nnx.Rngs(0))
      >>> px.models.generate(model, jnp.array([[1, 2, 3]]), 5).shape
      (1, 8)

    References:
      Hugging Face transformers ``generate`` and its logits warpers; Pope et al., 2022.
    """
    prompt, settings = _checked(model, prompt_ids, max_new_tokens, temperature, top_k, top_p,
                                seed)
    if getattr(model, "dropout_active", lambda: False)():
        # decoding is inference, as transformers' generate on a model in eval mode: dropout
        # off in a view (the caller's model stays in train mode)
        model = nnx.view(model, deterministic=True)
    if (mesh is None) != (strategy is None):
        raise ValueError(f"{API}: pass mesh= and strategy= together (the training layout), "
                         f"or neither (one device); got mesh={mesh!r}, strategy={strategy!r}.")
    if mesh is None:
        return _decode_jitted(model, prompt, int(max_new_tokens), settings, seed)
    _check_layout(mesh, strategy, prompt.shape[0])

    @eval_step(mesh, strategy)
    def decode(model, batch):
        return _decode(model, batch["prompt_ids"], int(max_new_tokens), settings, seed)

    return decode(model, {"prompt_ids": prompt})
