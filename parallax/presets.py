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


def parse(name: str, tensor: int = 2) -> tuple[dict[str, int], Strategy]:
    """Mesh axis sizes and the composed strategy for a name like ``"dp+fsdp+tp"``.

    Tensor parallelism takes ``tensor`` devices (all of them when it is alone). With both
    ``dp`` and a ZeRO part, ZeRO's axis takes 2 devices and ``data`` the rest; otherwise the
    one data-like axis takes what remains (``-1``: ``px.make_mesh`` fills it and checks the
    product).

    Example:
      >>> axes, strategy = parse("dp+fsdp+tp")
      >>> axes
      {'tensor': 2, 'fsdp': 2, 'data': -1}
    """
    spelled = ALIASES.get(name, name)
    parts = [p for p in spelled.split("+") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise ValueError(
            f"parallax: unknown strategy {name!r}; combine parts with '+' from "
            f"{', '.join(PARTS)} (or the aliases {', '.join(ALIASES)}), e.g. 'dp+fsdp+tp'."
        )
    axes_needed = [PARTS[p][0] for p in parts]
    sizes: dict[str, int] = {}
    if "tensor" in axes_needed:
        sizes["tensor"] = tensor if len(set(axes_needed)) > 1 else -1
    data_like = [a for a in ("data", "fsdp") if a in axes_needed]
    if len(data_like) == 2:
        sizes["fsdp"], sizes["data"] = 2, -1
    elif data_like:
        sizes[data_like[0]] = -1
    return sizes, compose(*(PARTS[p][1]() for p in parts))
