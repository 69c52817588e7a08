"""MoEConfig: the sizes and choices of a mixture-of-experts layer, validated on creation.

References:
  Shazeer et al. 2017, "Outrageously Large Neural Networks" (the sparsely-gated MoE layer);
  Lepikhin et al. 2020, "GShard" (top-2 gating, expert capacity, dropped tokens);
  Fedus et al. 2021, "Switch Transformers" (top-1, capacity factor, load-balancing loss);
  Zoph et al. 2022, "ST-MoE" (router z-loss); DeepSeek-AI 2024, "DeepSeek-V3" (sigmoid
  scores normalised over the chosen experts, a shared expert).
"""

from __future__ import annotations

import dataclasses
import math

SCORES = ("softmax", "sigmoid")
AUX_LOSSES = ("switch", "mixtral")
DEFAULT_Z_COEF = 0.001  # ST-MoE's weight of the z-loss, under aux_loss="switch"


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """How a ``parallax.nn.MoE`` layer (and the GPT's MoE blocks) route and compute.

    Args:
      num_experts: E, the number of SwiGLU experts (stored as one stacked weight whose
        leading dimension has the logical name ``"expert"``).
      top_k: k, experts per token: 1 (Switch) or 2 (GShard, Mixtral).
      mlp_dim: each expert's hidden width F; None uses the model's ``mlp_dim``.
      capacity_factor: each expert takes at most ``ceil(capacity_factor * S * k / E)``
        tokens of a sequence of S tokens (GShard's expert capacity, per sequence so that
        the same tokens drop however the batch is split); the rest are dropped (their MoE
        output is zero; the residual carries them). None: dropless (every token reaches its
        k experts).
      score: ``"softmax"`` (Switch, GShard) or ``"sigmoid"`` (DeepSeek-V3) router scores.
      shared_mlp_dim: hidden width of a shared SwiGLU expert every token also goes through
        (DeepSeek's shared expert); 0 for none.
      balance_coef: weight of the load-balancing loss in ``aux_loss``.
      z_coef: weight of the ST-MoE router z-loss in ``aux_loss``; None: 0.001 under
        ``aux_loss="switch"``, 0 under ``"mixtral"`` (which has no z-loss and refuses one).
      aux_loss: which auxiliary loss convention the model's loss adds (over all MoE
        layers): ``"switch"`` (parallax's default: per layer Switch's ``E sum_e f_e P_e``
        with ``f_e`` the share of all ``k N`` choices, summed over layers, plus the
        z-loss) or ``"mixtral"`` (Mixtral's as Hugging Face transformers computes it:
        ``f_e`` the choices per token, so ``k`` times Switch's, and ``f`` and ``P`` pooled
        over the layers before their product; no z-loss).

    Raises:
      TypeError: a size is not an int, or a coefficient is not a number.
      ValueError: ``num_experts < 1``, ``top_k`` not 1 or 2, ``top_k > num_experts``,
        ``capacity_factor <= 0``, an unknown score or ``aux_loss``, a negative size or
        coefficient, a z-loss with ``aux_loss="mixtral"``.

    Example:
      >>> from parallax.nn import MoEConfig
      >>> MoEConfig(num_experts=8, top_k=2, capacity_factor=1.0).capacity(16)
      4
    """

    num_experts: int = 4
    top_k: int = 2
    mlp_dim: int | None = None
    capacity_factor: float | None = 1.25
    score: str = "softmax"
    shared_mlp_dim: int = 0
    balance_coef: float = 0.01
    z_coef: float | None = None
    aux_loss: str = "switch"

    def __post_init__(self):
        api = "MoEConfig"
        for field in ("num_experts", "top_k", "mlp_dim", "shared_mlp_dim"):
            value = getattr(self, field)
            if value is None and field == "mlp_dim":
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{api}: {field} must be an int, got {type(value).__name__}: "
                                f"{value!r}.")
        if self.num_experts < 1:
            raise ValueError(f"{api}: num_experts={self.num_experts} must be >= 1.")
        if self.top_k not in (1, 2):
            raise ValueError(f"{api}: top_k={self.top_k} must be 1 (Switch) or 2 (GShard).")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"{api}: top_k={self.top_k} > num_experts={self.num_experts}: a token cannot "
                f"go to {self.top_k} different experts out of {self.num_experts}; use "
                f"top_k <= {self.num_experts} or more experts.")
        if self.mlp_dim is not None and self.mlp_dim < 1:
            raise ValueError(f"{api}: mlp_dim={self.mlp_dim} must be >= 1 (or None).")
        if self.shared_mlp_dim < 0:
            raise ValueError(f"{api}: shared_mlp_dim={self.shared_mlp_dim} must be >= 0 "
                             "(0: no shared expert).")
        cf = self.capacity_factor
        if cf is not None:
            if isinstance(cf, bool) or not isinstance(cf, (int, float)):
                raise TypeError(f"{api}: capacity_factor must be a number or None (dropless), "
                                f"got {type(cf).__name__}: {cf!r}.")
            if not cf > 0:
                raise ValueError(
                    f"{api}: capacity_factor={cf!r} must be > 0 (1.0: each expert takes its "
                    "even share S*k/E of a sequence's tokens; 1.25 is Switch's default), or "
                    "None for dropless routing.")
        if self.score not in SCORES:
            raise ValueError(f"{api}: score={self.score!r} must be one of {SCORES}.")
        if self.aux_loss not in AUX_LOSSES:
            raise ValueError(f"{api}: aux_loss={self.aux_loss!r} must be one of {AUX_LOSSES} "
                             "('switch': per-layer Switch loss plus z-loss; 'mixtral': "
                             "Mixtral's pooled loss as transformers computes it).")
        if self.aux_loss == "mixtral" and self.z_coef:
            raise ValueError(f"{api}: z_coef={self.z_coef} with aux_loss='mixtral': Mixtral's "
                             "auxiliary loss has no router z-loss; leave z_coef=None (or 0), "
                             "or use aux_loss='switch'.")
        for field in ("balance_coef", "z_coef"):
            value = getattr(self, field)
            if value is None and field == "z_coef":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{api}: {field} must be a number, got {value!r}.")
            if value < 0:
                raise ValueError(f"{api}: {field}={value} must be >= 0.")

    @property
    def router_z_coef(self) -> float:
        """The z-loss weight in effect (``z_coef``, or the convention's default)."""
        if self.z_coef is not None:
            return self.z_coef
        return DEFAULT_Z_COEF if self.aux_loss == "switch" else 0.0

    @property
    def dropless(self) -> bool:
        return self.capacity_factor is None

    def capacity(self, tokens: int) -> int:
        """Slots per expert for a sequence of ``tokens`` tokens (at most ``tokens``).

        Dropless routing pads every expert to ``tokens`` slots where it pads (a pipeline
        stage under expert parallelism).
        """
        if self.dropless:
            return tokens
        slots = math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts)
        return max(1, min(tokens, slots))
