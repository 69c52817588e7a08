"""Predicted bytes per device of a training state under ZeRO, from the paper's accounting.

With ``P`` parameters stored in ``b`` bytes each and an optimizer keeping ``k`` moments of
``b_m`` bytes per parameter (Adam: k = 2), a device holds, between steps:

=======  ==========================  ===============================
stage    parameters                  optimizer state
=======  ==========================  ===============================
0        ``P * b``                   ``k * P * b_m``
1, 2     ``P * b``                   ``k * P * b_m / N``
3        ``P * b / N``               ``k * P * b_m / N``
=======  ==========================  ===============================

and during a step also the gradients: ``P * b`` for stages 0 and 1, ``P * b / N`` from stage 2.
This is table 1 of the ZeRO paper for fp32 training (no separate master copy).

References:
  Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
  Models", SC 2020, section 5.
"""

from __future__ import annotations


def zero_state_bytes(
    num_params: int,
    stage: int,
    shards: int,
    *,
    param_bytes: int = 4,
    moments: int = 2,
    moment_bytes: int = 4,
) -> float:
    """Parameters + optimizer state per device, between steps.

    Example:
      >>> zero_state_bytes(1_000_000, stage=3, shards=8)
      1500000.0
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_state_bytes: stage={stage} must be 0, 1, 2 or 3.")
    params = num_params * param_bytes / (shards if stage >= 3 else 1)
    optimizer = num_params * moments * moment_bytes / (shards if stage >= 1 else 1)
    return params + optimizer


def zero_gradient_bytes(num_params: int, stage: int, shards: int, *, grad_bytes: int = 4) -> float:
    """Gradient bytes per device during a step (sharded from stage 2).

    Example:
      >>> zero_gradient_bytes(1_000_000, stage=2, shards=4)
      1000000.0
    """
    return num_params * grad_bytes / (shards if stage >= 2 else 1)
