"""A cluster's two levels: devices in a node on a fast link, nodes joined by a network.

A :class:`Topology` says how many devices a node holds, the link between two devices of one
node (NVLink and NVSwitch, TPU ICI) and the network between nodes (InfiniBand, RoCE, TPU
DCN) with its bandwidth per node. The mesh's devices are laid out as ``px.make_mesh`` and
``px.make_hybrid_mesh`` lay them out (``parallax.mesh.LAYOUT_ORDER``: ``tensor`` innermost,
``stage`` outermost), so a node fills with the innermost axes first: :meth:`Topology.split`
says, for every axis, how many of its devices share a node and how many nodes it spans, and
:meth:`Topology.hybrid_axes` gives ``px.make_hybrid_mesh``'s ``ici`` and ``dcn`` for it.

A collective over a group of mesh axes with ``n_in`` devices in each node and ``n_out``
nodes is priced per level (:meth:`Topology.collective_seconds`), with ``S`` its message:

====================  ======================================================================
all-reduce            one node: a ring over the link; one device per node: a ring or a tree
                      over the network, the cheaper; both: hierarchical, a reduce-scatter
                      in the node, an all-reduce of ``S / n_in`` across, an all-gather in
                      the node
all-gather, reduce-   in the node on ``S``, across the nodes on ``S / n_in``
scatter
all-to-all            ``(n_in - 1) / n`` of ``S`` over the link and ``(n - n_in) / n`` over the
                      network, which the bisection bandwidth limits
collective-permute    one message, over the network when the axis spans nodes
====================  ======================================================================

Every device of a node runs its collectives at the same time (SPMD), so each has
``1 / devices_per_node`` of the node's network bandwidth: the ``network`` link is that
share (DGX nodes have one NIC per GPU).

References:
  Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations in
  MPICH", 2005 (rings, trees, the hierarchical all-reduce); Narayanan et al., "Efficient
  Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC 2021, section 5
  (Selene's DGX A100 nodes: 8 x 200 Gb/s HDR InfiniBand per node for the application, a
  three-level fat tree); NVIDIA DGX H100 and DGX A100 datasheets.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping

from parallax.comm import cost
from parallax.mesh import AXIS_ORDER, LAYOUT_ORDER

INTRA, INTER = "intra-node", "inter-node"


@dataclasses.dataclass(frozen=True)
class Topology:
    """Devices per node, the link inside a node, the network between nodes.

    Attributes:
      name: a short name (``"dgx-h100"``).
      chip: the ``parallax.planner.roofline`` chip preset of its devices.
      devices_per_node: devices in one node.
      intra: the link between two devices of a node (per device, one direction).
      network: what one device has of the node's network (per device, one direction: the
        node's bandwidth over ``devices_per_node``).
      bisection: the fraction of full bisection bandwidth the fabric offers between nodes
        (1.0: a non-blocking fat tree); all-to-alls across nodes are limited by it.
      source: where the numbers come from.
    """

    name: str
    chip: str
    devices_per_node: int
    intra: cost.Link
    network: cost.Link
    bisection: float = 1.0
    source: str = ""

    @property
    def node_bandwidth(self) -> float:
        """Bytes per second one node sends to the others (one direction)."""
        return self.network.bandwidth * self.devices_per_node

    def split(self, mesh_shape: Mapping[str, int]) -> dict[str, tuple[int, int]]:
        """``{axis: (devices in a node, nodes spanned)}``: nodes fill innermost axes first.

        An axis whose size shares no factor with the room left in a node is priced as
        spanning nodes.

        Example:
          >>> dgx = cluster("dgx-h100")
          >>> dgx.split({"stage": 4, "data": 16, "tensor": 8})
          {'tensor': (8, 1), 'data': (1, 16), 'stage': (1, 4)}
          >>> dgx.split({"data": 32, "fsdp": 4, "tensor": 2})
          {'tensor': (2, 1), 'fsdp': (4, 1), 'data': (1, 32)}
        """
        room, out = self.devices_per_node, {}
        for axis in reversed(LAYOUT_ORDER):
            if axis in mesh_shape:
                size = int(mesh_shape[axis])
                inner = math.gcd(size, room)
                out[axis] = (inner, size // inner)
                room //= inner
        return out

    def hybrid_axes(self, mesh_shape: Mapping[str, int]) -> tuple[dict, dict]:
        """``(ici, dcn)`` for ``px.make_hybrid_mesh``: each axis's part in a node and across.

        Raises:
          ValueError: the mesh does not fill whole nodes.

        Example:
          >>> cluster("dgx-h100").hybrid_axes({"data": 64, "tensor": 8})
          ({'data': 1, 'tensor': 8}, {'data': 64, 'tensor': 1})
        """
        split = self.split(mesh_shape)
        inside = math.prod(inner for inner, _ in split.values())
        total = math.prod(int(v) for v in mesh_shape.values())
        if total >= self.devices_per_node and inside != self.devices_per_node:
            raise ValueError(
                f"Topology.hybrid_axes: the mesh {_text(mesh_shape)} ({total} devices) does not "
                f"fill {self.name}'s nodes of {self.devices_per_node} devices (its innermost axes "
                f"put {inside} devices in a node); make the innermost axes' sizes multiply to a "
                f"multiple or divisor of {self.devices_per_node}.")
        ordered = [a for a in AXIS_ORDER if a in mesh_shape]
        return ({a: split[a][0] for a in ordered}, {a: split[a][1] for a in ordered})

    def group(self, axes: Iterable[str], mesh_shape: Mapping[str, int]) -> tuple[int, int]:
        """``(n_in, n_out)`` of a collective over ``axes``: devices per node, nodes."""
        split = self.split(mesh_shape)
        axes = [a for a in axes if a in split]
        return (math.prod(split[a][0] for a in axes), math.prod(split[a][1] for a in axes))

    def describe(self, mesh_shape: Mapping[str, int]) -> str:
        """``'tensor=8 in a node; data=64 across nodes'``: where each axis lives.

        Example:
          >>> cluster("dgx-a100").describe({"stage": 2, "data": 4, "tensor": 8})
          'tensor=8 in a node; stage=2 x data=4 across nodes'
        """
        split = self.split(mesh_shape)
        inside = [f"{a}={i}" for a, (i, o) in split.items() if i > 1]
        across = [f"{a}={o}" for a, (i, o) in reversed(split.items()) if o > 1]
        parts = ([" x ".join(inside) + " in a node"] if inside else []) + (
            [" x ".join(across) + " across nodes"] if across else [])
        return "; ".join(parts) or "one device"

    def collective_seconds(self, kind: str, axes: Iterable[str], mesh_shape: Mapping[str, int],
                           message_bytes: float, count: int = 1) -> dict[str, float]:
        """``{"intra-node": s, "inter-node": s}`` for ``count`` collectives moving
        ``message_bytes`` in all over ``axes`` (see the module docstring).

        Example:
          >>> dgx = cluster("dgx-h100")
          >>> inside = dgx.collective_seconds("all-reduce", ["tensor"], {"data": 2, "tensor": 8},
          ...                                 1e9)
          >>> across = dgx.collective_seconds("all-reduce", ["data"], {"data": 2, "tensor": 8},
          ...                                 1e9)
          >>> round(inside["intra-node"] * 1e3, 2), inside["inter-node"]
          (3.93, 0.0)
          >>> round(across["inter-node"] * 1e3, 1)   # 1 GB at 50 GB/s: a 2-way ring
          20.0
        """
        n_in, n_out = self.group(axes, mesh_shape)
        count = max(int(count), 1)
        each = message_bytes / count
        out = {INTRA: 0.0, INTER: 0.0}
        if n_in * n_out <= 1 or message_bytes <= 0:
            return out
        if kind == "all-reduce":
            if n_out == 1:
                out[INTRA] = cost.ring_all_reduce_time(each, n_in, self.intra)
            else:
                out[INTRA] = 2 * cost.ring_reduce_scatter_time(each, n_in, self.intra)
                out[INTER] = cost.all_reduce_time(each / n_in, n_out, self.network, "xla")
        elif kind in ("all-gather", "reduce-scatter"):
            out[INTRA] = cost.ring_reduce_scatter_time(each, n_in, self.intra)
            out[INTER] = cost.ring_reduce_scatter_time(each / n_in, n_out, self.network)
        elif kind == "all-to-all":
            n = n_in * n_out
            if n_in > 1:
                out[INTRA] = self.intra.time((n_in - 1) / n * each, n_in - 1)
            if n_out > 1:
                out[INTER] = self.network.time((n - n_in) / n * each / self.bisection, n - n_in)
        elif kind == "collective-permute":
            out[INTER if n_out > 1 else INTRA] = (self.network if n_out > 1
                                                  else self.intra).time(each, 1)
        else:
            raise ValueError(f"Topology.collective_seconds: unknown collective kind {kind!r}; "
                             "use all-reduce, all-gather, reduce-scatter, all-to-all or "
                             "collective-permute.")
        return {level: count * seconds for level, seconds in out.items()}


def _text(shape: Mapping[str, int]) -> str:
    return " x ".join(f"{a}={n}" for a, n in shape.items())


CLUSTERS: dict[str, Topology] = {
    "dgx-h100": Topology(
        "dgx-h100", "h100", 8, cost.PRESETS["nvlink-h100"], cost.PRESETS["infiniband-ndr"],
        1.0, "NVIDIA DGX H100 datasheet: 8 H100 SXM on NVLink 4 through NVSwitch (900 GB/s "
        "per GPU, both directions), 8 x ConnectX-7 400 Gb/s NDR InfiniBand for compute, one "
        "per GPU (400 GB/s per node each way); a non-blocking fat tree (DGX SuperPOD) assumed."),
    "dgx-a100": Topology(
        "dgx-a100", "a100", 8, cost.PRESETS["nvlink-a100"], cost.PRESETS["infiniband-hdr"],
        1.0, "NVIDIA DGX A100 80 GB as on Selene (Narayanan et al. 2021, section 5): 8 A100 "
        "on NVSwitch (600 GB/s per GPU, both directions), 8 x 200 Gb/s HDR InfiniBand HCAs "
        "for the application (200 GB/s per node each way), a three-level fat tree."),
}


def cluster(name: str | Topology) -> Topology:
    """A :class:`Topology` by preset name (a ``Topology`` is returned as is).

    Example:
      >>> cluster("dgx-a100").node_bandwidth / 1e9
      200.0
    """
    if isinstance(name, Topology):
        return name
    try:
        return CLUSTERS[name]
    except KeyError:
        raise ValueError(
            f"topology.cluster: unknown cluster {name!r}; the presets are "
            f"{', '.join(CLUSTERS)} (or pass a parallax.planner.topology.Topology(name, chip, "
            "devices_per_node, intra, network))."
        ) from None


def single_node(chip: str, link: cost.Link, devices: int) -> Topology:
    """One node of ``devices`` on ``link``: what a chip and a link alone describe."""
    return Topology(f"one node ({link.name})", chip, max(int(devices), 1), link, link, 1.0,
                    link.source)
