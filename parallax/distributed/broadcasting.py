"""Make every process hold rank ``root``'s values: DDP's broadcast of parameters at start.

PyTorch DDP copies rank 0's parameters and buffers to every process when the model is
wrapped, and Horovod's ``broadcast_parameters`` does the same, so that processes started with
different seeds train one model. :func:`broadcast` does it for any pytree:

- process-local leaves (numpy, Python numbers, arrays on this process's devices) take the
  root process's values;
- global ``jax.Array`` s (a state from ``px.init``) keep their sharding; wherever a shard is
  held by several devices (replicated over some mesh axes), every copy takes the value of
  the copy on the root process, or, where the root holds none, of the first device holding
  it. One jitted ``shard_map`` per mesh does it with a ``psum`` of the chosen copy.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from parallax.distributed import local_arrays
from parallax.rules import as_tuple

API = "px.distributed.broadcast"


def _check_root(root) -> int:
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)):
        raise TypeError(f"{API}: root must be an int (a process id), got {type(root).__name__}.")
    if not 0 <= root < jax.process_count():
        raise ValueError(f"{API}: root={root} is not a process of this job; process ids run "
                         f"0 .. {jax.process_count() - 1}.")
    return int(root)


def owners(mesh, spec: PartitionSpec, root: int) -> np.ndarray:
    """One flag per device of ``mesh``: the copy every replica of its shard takes.

    Example:
      >>> import parallax as px
      >>> owners(px.make_mesh(data=4, tensor=2), PartitionSpec(None, "tensor"), 0).astype(int)
      array([[1, 1],
             [0, 0],
             [0, 0],
             [0, 0]])
    """
    names = list(mesh.axis_names)
    used = {a for entry in spec if entry is not None for a in as_tuple(entry)}
    kept = [i for i, n in enumerate(names) if n in used]
    groups: dict[tuple, list[tuple]] = {}
    for index in np.ndindex(mesh.devices.shape):
        groups.setdefault(tuple(index[i] for i in kept), []).append(index)
    flags = np.zeros(mesh.devices.shape, bool)
    for members in groups.values():
        on_root = [i for i in members if mesh.devices[i].process_index == root]
        flags[(on_root or members)[0]] = True
    return flags


def _global_group(leaves: list[jax.Array], root: int) -> list[jax.Array]:
    """Broadcast global arrays that share one mesh (one program for all of them)."""
    mesh = leaves[0].sharding.mesh
    names = tuple(mesh.axis_names)
    specs = [x.sharding.spec for x in leaves]
    flag_spec = PartitionSpec(*names)
    flag_arrays = []
    for spec in specs:
        flags = owners(mesh, spec, root)
        flag_arrays.append(jax.make_array_from_callback(
            flags.shape, NamedSharding(mesh, flag_spec), lambda index, f=flags: f[index]))

    def body(xs, fs):
        out = []
        for x, f, spec in zip(xs, fs, specs):
            used = {a for e in spec if e is not None for a in as_tuple(e)}
            rest = tuple(n for n in names if n not in used)
            if not rest:
                out.append(x)
                continue
            wide = x.astype(jnp.int32) if x.dtype == jnp.bool_ else x
            total = lax.psum(jnp.where(f.reshape(()), wide, jnp.zeros_like(wide)), rest)
            out.append(total.astype(x.dtype))
        return out

    program = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, [flag_spec] * len(specs)),
                                    out_specs=specs, check_vma=False))
    return program(leaves, flag_arrays)


@functools.cache
def _pick(root: int):
    """Keeps row ``root`` of every array, replicated (one jitted program per root)."""
    return jax.jit(lambda rows: [r[root] for r in rows], out_shardings=local_arrays.replicated())


def _local_group(leaves: list, root: int) -> list:
    """Broadcast process-local values: one row per process, keep the root's row."""
    values = [np.asarray(x) for x in leaves]
    rows = [local_arrays.stack(local_arrays.as_bytes(v)) for v in values]
    picked = _pick(root)(rows)
    return [local_arrays.like(local_arrays.from_bytes(local_arrays.local_copy(p), v.dtype,
                                                      v.shape), x)
            for p, v, x in zip(picked, values, leaves)]


def broadcast(tree, root: int = 0):
    """``tree`` with every leaf equal to process ``root``'s (a no-op for one process).

    Every process must call it with a tree of the same structure, shapes and dtypes.

    Args:
      tree: a pytree of numpy arrays, Python numbers, process-local or global
        ``jax.Array`` s (sharded states keep their sharding).
      root: the process whose values win.

    Returns:
      The tree, each leaf of the same kind, shape, dtype and sharding.

    Example:
      >>> import numpy as np, parallax as px
      >>> px.distributed.broadcast({"w": np.ones(3)}, root=0)["w"]
      array([1., 1., 1.])

    References:
      PyTorch DDP (the model's state is broadcast from rank 0 at construction); Horovod
      ``broadcast_parameters``.
    """
    root = _check_root(root)
    if jax.process_count() == 1:
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    out = list(leaves)
    local = [i for i, x in enumerate(leaves) if local_arrays.is_local(x)]
    if local:
        for i, value in zip(local, _local_group([leaves[i] for i in local], root)):
            out[i] = value
    by_mesh: dict = {}
    for i, x in enumerate(leaves):
        if i in local:
            continue
        if not (isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding)):
            raise TypeError(
                f"{API}: the leaf {jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(tree)[0][i][0])} "
                f"is a {type(x).__name__} with sharding {getattr(x, 'sharding', None)}; pass "
                "numpy arrays, process-local arrays or global arrays with a NamedSharding.")
        by_mesh.setdefault(x.sharding.mesh, []).append(i)
    for indices in by_mesh.values():
        for i, value in zip(indices, _global_group([leaves[i] for i in indices], root)):
            out[i] = value
    return jax.tree.unflatten(treedef, out)
