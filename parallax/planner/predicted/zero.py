"""Predicted bytes per device of a training state under ZeRO, from the paper's accounting.

With ``P`` parameters stored in ``b`` bytes each, an optimizer keeping ``k`` moments of
``b_m`` bytes per parameter (Adam: k = 2) and, in mixed precision, an fp32 master copy of
``b_w`` bytes per parameter, a device holds, between steps:

=======  ==========================  =======================================
stage    parameters                  optimizer state
=======  ==========================  =======================================
0        ``P * b``                   ``(k * b_m + b_w) * P``
1, 2     ``P * b``                   ``(k * b_m + b_w) * P / N``
3        ``P * b / N``               ``(k * b_m + b_w) * P / N``
=======  ==========================  =======================================

and during a step also the gradients: ``P * b_g`` for stages 0 and 1, ``P * b_g / N`` from
stage 2. fp32 training (the default) has no separate master copy (``b_w = 0``). The paper's
"model states" (:func:`zero_model_states_bytes`) are the three together, in its terms:
``(2 + 2 + K) * P`` bytes with fp16 parameters and gradients and ``K = 12`` bytes of
optimizer state per parameter (fp32 master weights, momentum and variance), divided by
``N`` part by part as the stage says. For 7.5B parameters on 64 devices that is the
paper's figure 1: 120, 31.4, 16.6 and 1.9 GB for the baseline and stages 1-3.

References:
  Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
  Models", SC 2020, section 5 and figure 1.
"""

from __future__ import annotations

API = "parallax.planner.predicted.zero"


def _check(num_params, stage, shards, fn: str, **sizes) -> None:
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(f"{fn}: stage={stage!r} must be 0 (no ZeRO), 1, 2 or 3.")
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise ValueError(f"{fn}: shards={shards!r} must be a positive int (the devices the "
                         "state is sharded over; 1 for none).")
    if isinstance(num_params, bool) or not isinstance(num_params, (int, float)) or num_params < 0:
        raise ValueError(f"{fn}: num_params={num_params!r} must be a non-negative number.")
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{fn}: {name}={value!r} must be a non-negative number of bytes.")


def zero_state_bytes(
    num_params: int,
    stage: int,
    shards: int,
    *,
    param_bytes: int = 4,
    moments: int = 2,
    moment_bytes: int = 4,
    master_bytes: int = 0,
) -> float:
    """Parameters + optimizer state per device, between steps.

    Args:
      num_params: the parameter count ``P``.
      stage: 0 (no ZeRO), 1, 2 or 3.
      shards: the devices the state is sharded over ``N``.
      param_bytes: bytes per parameter as stored (4 for fp32, 2 for bf16 / fp16).
      moments: optimizer moments per parameter (Adam: 2).
      moment_bytes: bytes per moment entry.
      master_bytes: bytes of an fp32 master copy per parameter (4 in mixed precision, 0
        in fp32 training).

    Returns:
      Bytes per device.

    Example:
      >>> zero_state_bytes(1_000_000, stage=3, shards=8)
      1500000.0
    """
    _check(num_params, stage, shards, "zero_state_bytes", param_bytes=param_bytes,
           moments=moments, moment_bytes=moment_bytes, master_bytes=master_bytes)
    params = num_params * param_bytes / (shards if stage >= 3 else 1)
    optimizer = num_params * (moments * moment_bytes + master_bytes) / (
        shards if stage >= 1 else 1)
    return params + optimizer


def zero_gradient_bytes(num_params: int, stage: int, shards: int, *, grad_bytes: int = 4) -> float:
    """Gradient bytes per device during a step (sharded from stage 2).

    Example:
      >>> zero_gradient_bytes(1_000_000, stage=2, shards=4)
      1000000.0
    """
    _check(num_params, stage, shards, "zero_gradient_bytes", grad_bytes=grad_bytes)
    return num_params * grad_bytes / (shards if stage >= 2 else 1)


def zero_model_states_bytes(
    num_params: int,
    stage: int,
    shards: int,
    *,
    param_bytes: int = 2,
    grad_bytes: int = 2,
    optimizer_bytes: int = 12,
) -> float:
    """The ZeRO paper's model states per device: parameters, gradients, optimizer state.

    The defaults are the paper's mixed-precision Adam: fp16 parameters and gradients
    (2 + 2 bytes) and ``K = 12`` bytes of optimizer state (fp32 master weights, momentum,
    variance). Stage 1 divides the optimizer state by ``N``, stage 2 also the gradients,
    stage 3 also the parameters.

    Args:
      num_params: the parameter count ``P`` (the paper's Psi).
      stage: 0 (the data-parallel baseline), 1 (P_os), 2 (P_os+g) or 3 (P_os+g+p).
      shards: the data-parallel degree ``N`` (``N_d``).
      param_bytes, grad_bytes: bytes per parameter and per gradient entry.
      optimizer_bytes: ``K``, bytes of optimizer state per parameter.

    Returns:
      Bytes per device.

    Example:
      >>> [round(zero_model_states_bytes(7.5e9, s, 64) / 1e9, 1) for s in range(4)]
      [120.0, 31.4, 16.6, 1.9]
    """
    _check(num_params, stage, shards, "zero_model_states_bytes", param_bytes=param_bytes,
           grad_bytes=grad_bytes, optimizer_bytes=optimizer_bytes)
    return (num_params * param_bytes / (shards if stage >= 3 else 1)
            + num_params * grad_bytes / (shards if stage >= 2 else 1)
            + num_params * optimizer_bytes / (shards if stage >= 1 else 1))
