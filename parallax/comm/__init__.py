"""parallax.comm: collectives inside ``shard_map``, and the algorithms behind them.

Every function runs inside ``jax.shard_map`` over a named mesh axis, on an array or a pytree:

* validated wrappers over ``lax``: :func:`all_reduce`, :func:`all_gather`,
  :func:`reduce_scatter`, :func:`broadcast`, :func:`reduce`, :func:`all_to_all`,
  :func:`send`, :func:`shift`;
* algorithms built only from point-to-point steps (``ppermute``): :func:`ring_reduce_scatter`,
  :func:`ring_all_gather`, :func:`ring_all_reduce`, :func:`tree_all_reduce`,
  :func:`tree_broadcast`, :func:`hierarchical_all_reduce` (two mesh axes);
* tensor fusion: :func:`bucketed_all_reduce`, :func:`pack_buckets`;
* compression: :class:`Compression` (bf16/fp16 on the wire) and
  :func:`quantized_all_reduce` (blockwise int8);
* :mod:`parallax.comm.cost`: the alpha-beta model and hardware presets (``algorithm="auto"``);
* :mod:`parallax.comm.bench`: the nccl-tests style benchmark (``parallax bench comm``).

Example:
  >>> import jax, jax.numpy as jnp
  >>> from parallax import comm
  >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  >>> f = jax.jit(jax.shard_map(lambda g: comm.all_reduce(g, "data", algorithm="ring"), mesh=mesh,
  ...                   in_specs=jax.P("data"), out_specs=jax.P("data")))
  >>> f(jnp.arange(8.0)).tolist()
  [28.0, 28.0, 28.0, 28.0, 28.0, 28.0, 28.0, 28.0]
"""

from parallax.comm import cost as cost
from parallax.comm.bucket import Bucket as Bucket
from parallax.comm.bucket import pack_buckets as pack_buckets
from parallax.comm.bucket import bucketed_all_reduce as bucketed_all_reduce
from parallax.comm.compress import Compression as Compression
from parallax.comm.hierarchical import hierarchical_all_reduce as hierarchical_all_reduce
from parallax.comm.p2p import send as send
from parallax.comm.p2p import shift as shift
from parallax.comm.quantize import dequantize_int8 as dequantize_int8
from parallax.comm.quantize import quantize_int8 as quantize_int8
from parallax.comm.quantize import quantized_all_reduce as quantized_all_reduce
from parallax.comm.quantize import quantized_error_bound as quantized_error_bound
from parallax.comm.ring import ring_all_gather as ring_all_gather
from parallax.comm.ring import ring_all_reduce as ring_all_reduce
from parallax.comm.ring import ring_reduce_scatter as ring_reduce_scatter
from parallax.comm.ring import ring_schedule as ring_schedule
from parallax.comm.tree import tree_all_reduce as tree_all_reduce
from parallax.comm.tree import tree_broadcast as tree_broadcast
from parallax.comm.tree import tree_rounds as tree_rounds
from parallax.comm.wrappers import all_gather as all_gather
from parallax.comm.wrappers import all_reduce as all_reduce
from parallax.comm.wrappers import all_to_all as all_to_all
from parallax.comm.wrappers import broadcast as broadcast
from parallax.comm.wrappers import reduce as reduce
from parallax.comm.wrappers import reduce_scatter as reduce_scatter
from parallax.old_import_paths import renamed_names as _renamed_names

__all__ = [
    "Bucket",
    "Compression",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "pack_buckets",
    "bucketed_all_reduce",
    "cost",
    "dequantize_int8",
    "hierarchical_all_reduce",
    "quantize_int8",
    "quantized_all_reduce",
    "quantized_error_bound",
    "reduce",
    "reduce_scatter",
    "ring_all_gather",
    "ring_all_reduce",
    "ring_reduce_scatter",
    "ring_schedule",
    "shift",
    "send",
    "tree_all_reduce",
    "tree_broadcast",
    "tree_rounds",
]

__getattr__ = _renamed_names("parallax.comm", globals())  # pre-round-3 names, with a warning
