"""Named strategies for the command line: ``"dp+fsdp+tp"`` -> a mesh shape and a strategy."""

from __future__ import annotations

from parallax.strategies import DataParallel, TensorParallel, ZeRO
from parallax.strategy import Strategy, compose

# Each part: (mesh axis it needs, factory). The data-like parts share the devices that
# tensor parallelism leaves.
PARTS = {
    "dp": ("data", lambda: DataParallel("data")),
    "zero1": ("fsdp", lambda: ZeRO(1, "fsdp")),
    "zero2": ("fsdp", lambda: ZeRO(2, "fsdp")),
    "zero3": ("fsdp", lambda: ZeRO(3, "fsdp")),
    "fsdp": ("fsdp", lambda: ZeRO(3, "fsdp")),
    "tp": ("tensor", lambda: TensorParallel("tensor")),
    "tp-sp": ("tensor", lambda: TensorParallel("tensor", sequence_parallel=True)),
}
ALIASES = {"hsdp": "dp+fsdp", "3d": "dp+fsdp+tp"}


def parse(name: str, tensor: int = 2, devices: int = 8) -> tuple[dict[str, int], Strategy]:
    """Mesh axis sizes and the composed strategy for a name like ``"dp+fsdp+tp"``.

    The sizes fit ``devices`` (so the demo runs on one GPU as on 8 simulated CPUs):
    tensor parallelism takes the largest divisor of ``devices`` that is at most ``tensor``;
    the data-like parts share what it leaves, ZeRO's axis taking 2 of them when ``dp`` is
    present too. Tensor parallelism alone uses only its own devices.

    Example:
      >>> axes, strategy = parse("dp+fsdp+tp")
      >>> axes
      {'tensor': 2, 'fsdp': 2, 'data': 2}
      >>> parse("dp+fsdp+tp", devices=1)[0]
      {'tensor': 1, 'fsdp': 1, 'data': 1}
    """
    spelled = ALIASES.get(name, name)
    parts = [p for p in spelled.split("+") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise ValueError(
            f"parallax: unknown strategy {name!r}; combine parts with '+' from "
            f"{', '.join(PARTS)} (or the aliases {', '.join(ALIASES)}), e.g. 'dp+fsdp+tp'."
        )
    if devices < 1 or tensor < 1:
        raise ValueError(f"parallax: devices={devices} and tensor={tensor} must be >= 1.")
    axes_needed = [PARTS[p][0] for p in parts]
    sizes: dict[str, int] = {}
    rest = devices
    if "tensor" in axes_needed:
        sizes["tensor"] = max(d for d in range(1, min(tensor, devices) + 1) if devices % d == 0)
        rest //= sizes["tensor"]
    data_like = [a for a in ("data", "fsdp") if a in axes_needed]
    if len(data_like) == 2:
        sizes["fsdp"] = 2 if rest % 2 == 0 else 1
        sizes["data"] = rest // sizes["fsdp"]
    elif data_like:
        sizes[data_like[0]] = rest
    return sizes, compose(*(PARTS[p][1]() for p in parts))
