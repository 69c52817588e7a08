"""``DistributedOptimizer(num_groups=, groups=)``: Horovod's explicit grouping of gradients.

Horovod (horovod/torch/optimizer.py, horovod/tensorflow/__init__.py) lets a user say which
gradients are all-reduced together: ``num_groups=k`` splits the parameters, in order, into
``k`` groups of about equal count; ``groups=[[...], [...]]`` names each group's parameters,
and a parameter in no list is a group of its own. Each group is one
``grouped_allreduce``. Here a group is one flat fused all-reduce per dtype (the fusion
threshold does not split it), and the parameters are named by their pytree path
(``jax.tree_util.keystr``, e.g. ``"['w1']"``); a name also matches every leaf below it
(``"['encoder']"``).

Example:
  >>> import jax.numpy as jnp
  >>> params = {"a": jnp.ones(2), "b": jnp.ones(2), "c": jnp.ones(2)}
  >>> assign(params, num_groups=2, groups=None)
  [[0], [1, 2]]
  >>> assign(params, num_groups=0, groups=[["['a']", "['c']"]])
  [[0, 2], [1]]

References:
  Horovod ``DistributedOptimizer(num_groups=, groups=)`` (horovod/torch/optimizer.py,
  ``split_list`` in horovod/common/util.py).
"""

from __future__ import annotations

import jax

API = "hvd.DistributedOptimizer"


def check(num_groups, groups) -> None:
    """Validates the two arguments at construction."""
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 0:
        raise ValueError(f"{API}: num_groups={num_groups!r} must be an int >= 0 (0: no "
                         "explicit groups).")
    if groups is not None:
        if num_groups:
            raise ValueError(f"{API}: pass num_groups= or groups=, not both.")
        if not isinstance(groups, (list, tuple)) or not all(
                isinstance(g, (list, tuple)) and g and all(isinstance(n, str) for n in g)
                for g in groups):
            raise TypeError(f"{API}: groups must be a list of non-empty lists of parameter "
                            "paths (jax.tree_util.keystr, e.g. [[\"['w1']\", \"['b1']\"]]), "
                            f"got {groups!r}.")


def assign(tree, num_groups: int, groups) -> list[list[int]] | None:
    """The leaf indices of each group, in tree order; None when there are no groups."""
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    if num_groups:
        n, k = len(paths), min(num_groups, len(paths))
        return [list(range(i * n // k, (i + 1) * n // k)) for i in range(k)]
    if groups is None:
        return None
    taken: dict[int, str] = {}
    out = []
    for group in groups:
        indices = []
        for name in group:
            hits = [i for i, p in enumerate(paths) if p == name or p.startswith(name)]
            if not hits:
                raise ValueError(f"{API}: groups names {name!r}, which is no parameter path; "
                                 f"the paths are {paths}.")
            for i in hits:
                if i in taken and taken[i] != repr(group):
                    raise ValueError(f"{API}: parameter {paths[i]} is in two groups.")
                taken[i] = repr(group)
            indices += [i for i in hits if i not in indices]
        out.append(sorted(indices))
    return out + [[i] for i in range(len(paths)) if i not in taken]
