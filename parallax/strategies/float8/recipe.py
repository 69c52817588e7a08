"""The float8 recipe: which scaling, which modules, and whether FSDP gathers in float8.

A :class:`Float8Recipe` is a frozen value (what ``px.Float8`` holds in
``Strategy.float8``), validated on creation with errors that name the setting and the fix.

References:
  torchao ``torchao/float8/config.py`` (``Float8LinearConfig``: ``enable_fsdp_float8_all_gather``,
  ``round_scales_to_power_of_2``, the ``TENSORWISE`` and ``ROWWISE`` recipes);
  Transformer Engine ``transformer_engine/common/recipe/__init__.py`` (``Format.HYBRID``:
  e4m3 forward, e5m2 backward; ``DelayedScaling``, ``Float8CurrentScaling``).
"""

from __future__ import annotations

import dataclasses

API = "px.Float8"
SCALINGS = ("tensorwise", "rowwise")
AMAX_ALGOS = ("max", "most_recent")


@dataclasses.dataclass(frozen=True)
class Float8Recipe:
    """How the dense matmuls of a step run in float8 (see ``px.Float8`` for the fields).

    Example:
      >>> Float8Recipe().describe()
      'tensorwise, current scaling, e4m3 forward / e5m2 gradients, FSDP gathers in float8'
    """

    scaling: str = "tensorwise"
    delayed: bool = False
    amax_history_len: int = 16
    amax_compute_algo: str = "max"
    margin: float = 0.0
    power_of_2_scales: bool | None = None
    fsdp_float8_gather: bool | None = None
    skip: tuple[str, ...] = ()

    def __post_init__(self):
        if self.scaling not in SCALINGS:
            raise ValueError(f"{API}: scaling={self.scaling!r} is not one of {SCALINGS}; "
                             "'tensorwise' scales each tensor by one number (torchao's "
                             "default), 'rowwise' each row of the contracted dimension.")
        if self.delayed:
            if self.scaling != "tensorwise":
                raise ValueError(f"{API}: delayed scaling keeps one amax history per tensor, "
                                 f"so it is tensorwise only (Transformer Engine's DelayedScaling); "
                                 f"got scaling={self.scaling!r}. Use scaling='tensorwise' or "
                                 "delayed=False.")
            if self.fsdp_float8_gather:
                raise ValueError(f"{API}: fsdp_float8_gather=True needs current scaling: the "
                                 "gathered weight is cast with its own amax, while delayed "
                                 "scaling casts it with its history's scale. Set "
                                 "fsdp_float8_gather=False, or delayed=False.")
        if not isinstance(self.amax_history_len, int) or self.amax_history_len < 1:
            raise ValueError(f"{API}: amax_history_len={self.amax_history_len!r} must be a "
                             "positive int (Transformer Engine defaults to 1024).")
        if self.amax_compute_algo not in AMAX_ALGOS:
            raise ValueError(f"{API}: amax_compute_algo={self.amax_compute_algo!r} is not one "
                             f"of {AMAX_ALGOS}.")
        gather = self.fsdp_float8_gather
        if gather and self.scaling != "tensorwise":
            raise ValueError(f"{API}: fsdp_float8_gather=True needs scaling='tensorwise': the "
                             "gathered weight carries one scale, which every shard agrees on "
                             "with one max all-reduce (torchao's float8 all-gather is "
                             "tensorwise only). Set fsdp_float8_gather=False, or use "
                             "scaling='tensorwise'.")
        if gather is None:
            object.__setattr__(self, "fsdp_float8_gather",
                               self.scaling == "tensorwise" and not self.delayed)
        if self.power_of_2_scales is None:
            object.__setattr__(self, "power_of_2_scales", self.scaling == "rowwise")
        if isinstance(self.skip, str) or not all(isinstance(s, str) for s in self.skip):
            raise TypeError(f"{API}: skip={self.skip!r} must be a tuple of module-path "
                            "substrings (skip=('head',) keeps modules whose path contains "
                            "'head' in high precision).")
        object.__setattr__(self, "skip", tuple(self.skip))

    def converts(self, path: str) -> bool:
        """Whether the module at dotted ``path`` runs its matmul in float8."""
        return not any(s in path for s in self.skip)

    def describe(self) -> str:
        when = "delayed" if self.delayed else "current"
        gather = ", FSDP gathers in float8" if self.fsdp_float8_gather else ""
        pow2 = ", power-of-2 scales" if self.power_of_2_scales else ""
        return (f"{self.scaling}, {when} scaling, e4m3 forward / e5m2 gradients"
                f"{pow2}{gather}")
