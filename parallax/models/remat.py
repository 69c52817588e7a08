"""Rematerialisation of the scanned layer body as a named policy: what the backward recomputes.

``GPTConfig(remat=...)`` and ``LlamaConfig(remat=...)`` wrap each layer of the scan in
``jax.checkpoint`` (``nnx.remat``) with one of

- ``"none"`` (the default): no checkpoint; autodiff keeps every residual of every layer.
- ``"full"``: keep only each layer's input; the backward runs the layer's forward again.
  Activation memory is one ``[B, T, D]`` per layer plus one layer's residuals.
- ``"dots"``: keep the outputs of the weight matmuls (``jax.checkpoint_policies.
  dots_with_no_batch_dims_saveable``, MaxText's ``"minimal"``); recompute the rest:
  norms, activations, and attention's two batched matmuls (the ``[T, S]`` scores are never
  kept, which is where the memory goes at long sequences).
- ``"offload"``: what ``"dots"`` keeps, moved to host memory between the forward and the
  backward (``offload_dot_with_no_batch_dims("device", "pinned_host")``; jax 0.10.2 and
  0.12.1 both ship it). On CPU, host memory is device memory: it compiles and changes
  nothing there.

FLOPs per token, with ``N`` the model's matmul parameters (PaLM's ``6 N + 12 L T D``
accounting, ``D`` the attention width ``H K``), ``N_b`` those of the ``L`` blocks (all of
``N`` but the ``D x V`` output projection), ``N_d = L F D`` those of each block's last
matmul (the MLP's down projection) and ``A = 4 L T D`` attention's forward flops:

- none: ``6 N + 3 A`` (= ``6 N + 12 L T D``, the model flops);
- full: ``6 N + 3 A + 2 (N_b - N_d) + A``: every block's forward once more, except its last
  matmul, whose output only joins the residual stream that the next layer keeps as its
  input (autodiff never needs it), and except the head outside the scan;
- dots, offload: ``6 N + 3 A + A`` (attention's scores and weighted sum once more).

Measured on CPU (``tests/models/test_remat.py``): the compiled program's matmul flops are
within 0.5% of these for the GPT and the Llama under each policy.

:func:`recomputed_flops_per_token` is the extra term; ``px.explain`` reports the compiled
program's matmul flops over the model flops next to ``1 + extra / model``.

References:
  Chen et al., "Training Deep Nets with Sublinear Memory Cost", 2016; Korthikanti et al.,
  "Reducing Activation Recomputation in Large Transformer Models", 2022 (selective
  recomputation); JAX's ``jax.checkpoint_policies``; Chowdhery et al., "PaLM", 2022,
  appendix B (the flops).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx

POLICIES = ("none", "full", "dots", "offload")


def check_policy(value, api: str) -> str:
    """``value`` if it names a policy, else a ValueError naming them."""
    if value not in POLICIES:
        raise ValueError(f"{api}: remat={value!r} is not a rematerialisation policy; use one "
                         f"of {POLICIES} ('none': keep every residual, 'full': recompute each "
                         "layer, 'dots': keep the matmul outputs, 'offload': those, on host).")
    return value


def checkpoint_policy(name: str):
    """The ``jax.checkpoint`` policy of a named one (None: save nothing, i.e. ``"full"``)."""
    policies = jax.checkpoint_policies
    if name == "dots":
        return policies.dots_with_no_batch_dims_saveable
    if name == "offload":
        return policies.offload_dot_with_no_batch_dims("device", "pinned_host")
    return None


def remat_layer(forward: Callable, name: str) -> Callable:
    """``forward(block, x)`` under the policy ``name`` (itself for ``"none"``).

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> layer = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
      >>> remat_layer(lambda m, x: m(x), "full")(layer, jnp.ones((2, 4))).shape
      (2, 4)
    """
    check_policy(name, "remat_layer")
    if name == "none":
        return forward
    # prevent_cse=False: inside a scan the loop already keeps XLA from merging the
    # recomputation with the forward (jax.checkpoint's documentation).
    return nnx.remat(forward, policy=checkpoint_policy(name), prevent_cse=False)


def recomputed_flops_per_token(name: str, block_matmul_params: int, last_matmul_params: int,
                               attention_flops: int) -> int:
    """The matmul flops per token the backward recomputes under policy ``name``.

    Args:
      name: the policy.
      block_matmul_params: ``N_b``, the matmul parameters of all the blocks.
      last_matmul_params: ``N_d``, those of every block's last matmul (``L F D``).
      attention_flops: ``A``, attention's forward flops per token over all layers
        (``4 L T H K``, the full ``T x T`` scores as PaLM counts them).

    Example:
      >>> recomputed_flops_per_token("full", 1000, 300, 40)
      1440
      >>> recomputed_flops_per_token("dots", 1000, 300, 40)
      40
    """
    check_policy(name, "recomputed_flops_per_token")
    if name == "full":
        return 2 * (block_matmul_params - last_matmul_params) + attention_flops
    if name in ("dots", "offload"):
        return attention_flops
    return 0
