"""Device meshes with parallax's fixed axis order, validated up front.

parallax names seven mesh axes and always lays the devices out in this order, outermost first:

    stage  ->  data  ->  fsdp  ->  expert  ->  context  ->  sequence  ->  tensor

The order puts the axes that talk most (tensor, then sequence and context) innermost, where the devices
are closest (same host, NVLink, neighbouring TPU chips), and the axis that talks least (pipeline
stages, one activation per micro-batch) outermost. ``jax.make_mesh`` then picks a physical
device order that respects the topology of the accelerator.

The mesh *names* its axes in a slightly different order, :data:`AXIS_ORDER`: ``stage`` after
the batch axes (``data, fsdp, expert, stage, context, sequence, tensor``), over the same devices (the device
array is transposed, so each stage still holds a contiguous block of devices). The explicit
style opens a ``shard_map`` over the batch axes and the pipeline runtime one over ``stage``
inside it; XLA 0.12 aborts the process when nested manual axes are out of the mesh's order
while an axis (``tensor``) stays automatic (:mod:`parallax.comm.nesting`), and naming
``stage`` after ``data`` and ``fsdp`` keeps every nesting parallax makes in order.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

# Where the devices go, outermost first (the axes that talk least outermost).
LAYOUT_ORDER: tuple[str, ...] = (
    "stage", "data", "fsdp", "expert", "context", "sequence", "tensor")
# The order of a mesh's axis names: the pipeline axis after the batch axes, so that the
# shard_map regions parallax nests (batch axes, then stage) follow the mesh's order.
AXIS_ORDER: tuple[str, ...] = (
    "data", "fsdp", "expert", "stage", "context", "sequence", "tensor")

_AXIS_TYPES = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}


def _axis_type(axis_types: str | AxisType) -> AxisType:
    if isinstance(axis_types, AxisType):
        return axis_types
    try:
        return _AXIS_TYPES[axis_types]
    except KeyError:
        raise ValueError(
            f"make_mesh: axis_types={axis_types!r} is not one of 'auto', 'explicit' "
            "(or a jax.sharding.AxisType)."
        ) from None


def _ordered_axes(api: str, axes: Mapping[str, int]) -> dict[str, int]:
    """Checks names and sizes and returns the axes in parallax's order."""
    for name, size in axes.items():
        if name not in LAYOUT_ORDER:
            raise ValueError(
                f"{api}: unknown mesh axis {name!r}; the axes are "
                f"{', '.join(LAYOUT_ORDER)} (in this order, outermost first)."
            )
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
            raise TypeError(f"{api}: axis {name}={size!r} must be an int (or -1).")
        if size == 0 or size < -1:
            raise ValueError(f"{api}: axis {name}={size} must be a positive size or -1.")
    return {name: int(axes[name]) for name in LAYOUT_ORDER if name in axes}


def _named(grid: np.ndarray, layout_names: tuple[str, ...], kind: AxisType) -> Mesh:
    """The mesh over ``grid`` (axes in ``layout_names`` order), its axes named in
    :data:`AXIS_ORDER`: the device array transposed, every device where it was."""
    names = tuple(a for a in AXIS_ORDER if a in layout_names)
    grid = np.asarray(grid).transpose([layout_names.index(a) for a in names])
    return Mesh(grid, names, axis_types=(kind,) * len(names))


def _factors(sizes: Mapping[str, int]) -> str:
    return " x ".join(f"{name}={size}" for name, size in sizes.items())


def resolve_axis_sizes(
    api: str, axes: Mapping[str, int], num_devices: int, unit: str = "devices"
) -> dict[str, int]:
    """Fills a ``-1`` axis with the remaining devices and checks the product.

    Example:
        >>> resolve_axis_sizes("make_mesh", {"data": -1, "tensor": 2}, 8)
        {'data': 4, 'tensor': 2}
    """
    sizes = _ordered_axes(api, axes)
    if not sizes:
        sizes = {"data": -1}
    fill = [name for name, size in sizes.items() if size == -1]
    if len(fill) > 1:
        raise ValueError(
            f"{api}: at most one axis may be -1 (the remaining devices), got "
            f"{_factors(sizes)}; give every axis but one an explicit size."
        )
    known = math.prod(size for size in sizes.values() if size != -1)
    if fill:
        if num_devices % known:
            raise ValueError(
                f"{api}: cannot fill {fill[0]}=-1: the other axes multiply to {known} "
                f"({_factors({k: v for k, v in sizes.items() if v != -1})}), which does not "
                f"divide the {num_devices} {unit}; choose sizes whose product divides "
                f"{num_devices}."
            )
        sizes[fill[0]] = num_devices // known
    elif known != num_devices:
        raise ValueError(
            f"{api}: the axis sizes multiply to {known} ({_factors(sizes)}) but there are "
            f"{num_devices} {unit}; make the product equal {num_devices}, or set one axis "
            "to -1 to use the remaining devices."
        )
    return sizes


def make_mesh(
    *,
    devices: Sequence[jax.Device] | None = None,
    axis_types: str | AxisType = "auto",
    **axes: int,
) -> Mesh:
    """Builds a device mesh whose axes follow parallax's fixed order.

    Args:
      devices: the devices to use; all of ``jax.devices()`` by default.
      axis_types: ``"auto"`` (the default: ``jit`` shardings and GSPMD decide layouts, and
        ``shard_map`` reshards its inputs) or ``"explicit"`` (sharding in types). Every axis
        gets the same type, passed to JAX explicitly so ``jax.make_mesh`` and
        ``jax.sharding.Mesh`` cannot disagree.
      **axes: sizes of any of ``stage``, ``data``, ``fsdp``, ``expert``, ``context``,
        ``sequence``, ``tensor``. One
        of them may be ``-1``: the devices that remain. Only the axes named appear in the
        mesh (size-1 axes included); with none named, the mesh is ``data=-1``.

    Returns:
      A ``jax.sharding.Mesh`` with the named axes in the order data, fsdp, expert, stage,
      context, sequence, tensor (:data:`AXIS_ORDER`), the devices laid out stage outermost.

    Raises:
      ValueError: an unknown axis, more than one ``-1``, or sizes whose product is not the
        number of devices (the message lists every factor).

    Example:
      >>> import parallax as px
      >>> mesh = px.make_mesh(data=2, fsdp=2, tensor=-1)   # on 8 devices: tensor=2
      >>> dict(mesh.shape)
      {'data': 2, 'fsdp': 2, 'tensor': 2}
      >>> mesh = px.make_mesh(stage=2, data=2, tensor=2)   # stage named after data
      >>> mesh.axis_names, [d.id for d in mesh.devices[0, 1]]   # stage 1: devices 4..7
      (('data', 'stage', 'tensor'), [4, 5])
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = resolve_axis_sizes("make_mesh", axes, len(devices))
    kind = _axis_type(axis_types)
    laid_out = jax.make_mesh(
        tuple(sizes.values()),
        tuple(sizes.keys()),
        axis_types=(kind,) * len(sizes),
        devices=devices,
    )
    return _named(laid_out.devices, tuple(sizes), kind)


def _granule_index(device: jax.Device) -> int:
    slice_index = getattr(device, "slice_index", None)
    return device.process_index if slice_index is None else slice_index


def make_hybrid_mesh(
    ici: Mapping[str, int],
    dcn: Mapping[str, int],
    *,
    devices: Sequence[jax.Device] | None = None,
    axis_types: str | AxisType = "auto",
) -> Mesh:
    """Builds a mesh over several slices or hosts: ``ici`` inside one, ``dcn`` across them.

    Each mesh axis has size ``ici[axis] * dcn[axis]``, with the DCN part outermost, so the
    collectives of an axis that is 1 in ``dcn`` never leave a slice (TPU ICI, or NVLink inside
    a host), and only the axes with a DCN factor (usually ``data`` or ``stage``) cross the
    slower network. This is the layout of JAX's ``mesh_utils.create_hybrid_device_mesh``,
    which builds it on real hardware. A granule is a TPU slice (``device.slice_index``) or,
    where devices have none, a process (a host on GPU and CPU clusters).

    When the devices all belong to one granule (one process simulating many CPU devices),
    they are split into ``prod(dcn)`` equal groups of consecutive devices that stand in for
    slices, so the same program can be tested on one machine.

    Args:
      ici: axis sizes within a granule; one may be ``-1``.
      dcn: axis sizes across granules; the product must equal the number of granules.
      devices: the devices; all of ``jax.devices()`` by default.
      axis_types: as in :func:`make_mesh`.

    Example:
      >>> import parallax as px
      >>> mesh = px.make_hybrid_mesh(ici={"fsdp": 4}, dcn={"data": 2})  # 8 devices
      >>> dict(mesh.shape)
      {'data': 2, 'fsdp': 4}
    """
    devices = list(jax.devices() if devices is None else devices)
    dcn_sizes = _ordered_axes("make_hybrid_mesh", dcn)
    if any(size == -1 for size in dcn_sizes.values()):
        raise ValueError("make_hybrid_mesh: dcn sizes must be explicit (no -1).")
    granules = sorted({_granule_index(d) for d in devices})
    num_dcn = math.prod(dcn_sizes.values())
    simulated = len(granules) == 1 and num_dcn > 1
    num_granules = num_dcn if simulated else len(granules)
    if num_dcn != num_granules:
        raise ValueError(
            f"make_hybrid_mesh: the dcn sizes multiply to {num_dcn} ({_factors(dcn_sizes)}) "
            f"but the devices form {num_granules} slices/processes; make the dcn product "
            f"equal {num_granules}."
        )
    if len(devices) % num_granules:
        raise ValueError(
            f"make_hybrid_mesh: {len(devices)} devices do not split into {num_granules} "
            "equal slices."
        )
    ici_sizes = resolve_axis_sizes(
        "make_hybrid_mesh", ici, len(devices) // num_granules, "devices per slice"
    )
    names = tuple(a for a in LAYOUT_ORDER if a in ici_sizes or a in dcn_sizes)
    ici_shape = tuple(ici_sizes.get(a, 1) for a in names)
    dcn_shape = tuple(dcn_sizes.get(a, 1) for a in names)
    grid = hybrid_device_grid(devices, ici_shape, dcn_shape, simulated=simulated)
    return _named(grid, names, _axis_type(axis_types))


def hybrid_device_grid(devices, ici_shape, dcn_shape, *, simulated: bool = False) -> np.ndarray:
    """The device array of a hybrid mesh: JAX's ``create_hybrid_device_mesh`` on real
    granules (slices, else processes), consecutive groups when ``simulated``."""
    if simulated:
        return _simulated_hybrid_grid(devices, ici_shape, dcn_shape)
    return mesh_utils.create_hybrid_device_mesh(
        ici_shape,
        dcn_shape,
        devices,
        process_is_granule=getattr(devices[0], "slice_index", None) is None,
    )


def _simulated_hybrid_grid(devices, ici_shape, dcn_shape) -> np.ndarray:
    """Consecutive device groups as slices; each axis is (dcn part, ici part), dcn outer."""
    n = len(ici_shape)
    grid = np.asarray(devices, dtype=object).reshape(dcn_shape + ici_shape)
    interleaved = [i for pair in zip(range(n), range(n, 2 * n)) for i in pair]
    grid = grid.transpose(interleaved)
    return grid.reshape(tuple(d * i for d, i in zip(dcn_shape, ici_shape)))


def axis_size(mesh: Mesh, axes: str | Sequence[str] | None) -> int:
    """The number of devices along one mesh axis or the product over several (1 for None)."""
    if axes is None:
        return 1
    if isinstance(axes, str):
        axes = (axes,)
    return math.prod(mesh.shape[a] for a in axes)


def axes_text(mesh: Mesh, axes: Sequence[str]) -> str:
    """``'data=2 x fsdp=4'``: some mesh axes with their sizes, for messages."""
    return _factors({a: mesh.shape[a] for a in axes})


def describe(mesh: Mesh) -> str:
    """``'data=2 x fsdp=2 x tensor=2 (8 cpu devices)'``: a mesh in one line for messages."""
    platform = mesh.devices.flat[0].platform
    return f"{_factors(dict(mesh.shape))} ({mesh.size} {platform} devices)"
