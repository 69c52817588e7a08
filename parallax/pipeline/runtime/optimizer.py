"""The train state's optimizer applied to a part of the parameters: one stage's layers.

With ``px.Pipeline(weights="stashed")`` every stage updates its own chunk of the stacked
layers after each micro-batch's backward, inside the runtime, and the parameters outside
the stack after the step. ``tx`` is the state's optax transformation, applied to a tree
that holds only the part (the other leaves ``None``): optax maps over the leaves it is
given, so its state for the part is the full state's leaves at the same key paths (the
moments that mirror those parameters, and the shared scalars such as Adam's count).
Transformations that look across leaves (a global-norm clip) see the part only: each
stage clips its own gradients, as PipeDream's per-stage optimizers do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import optax


class PartOptimizer(NamedTuple):
    """``tx`` on the ``part`` ("stacked" or "others") of the parameters.

    Attributes:
      tx: the transformation.
      tree: ``tree(stacked, others)``: a parameter-shaped tree from leaf lists (``None``
        where a list is not given), as :attr:`.program.Program.grads` builds it.
      part: ``"stacked"`` or ``"others"``.
      treedef: the structure of ``tx``'s state for the part.
      paths: the key path, in the full state, of each of the part state's leaves.
      mirrors: per leaf, whether it is shaped like the stacked layers ``[L, ...]`` (moved
        and sliced per chunk with them) rather than a shared scalar.
    """

    tx: optax.GradientTransformation
    tree: Callable
    part: str
    treedef: object
    paths: tuple
    mirrors: tuple

    def update(self, params: list, grads: list, state: list) -> tuple[list, list]:
        """One update of the part: new parameter leaves and new state leaves."""
        args = (params, None) if self.part == "stacked" else (None, params)
        grad_args = (grads, None) if self.part == "stacked" else (None, grads)
        p_tree, g_tree = self.tree(*args), self.tree(*grad_args)
        updates, new_state = self.tx.update(g_tree, jax.tree.unflatten(self.treedef, state),
                                            p_tree)
        new_params = optax.apply_updates(p_tree, updates)
        return self._in_order(new_params, len(params)), jax.tree.leaves(new_state)

    def _in_order(self, tree, count: int) -> list:
        """The part's leaves of ``tree`` in the order of the lists given to ``tree``."""
        marks = list(range(count))
        order = jax.tree.leaves(self.tree(marks, None) if self.part == "stacked"
                                else self.tree(None, marks))
        flat = jax.tree.leaves(tree)
        if len(flat) != count:
            raise AssertionError("pipeline optimizer: the part's parameters changed structure")
        out = [None] * count
        for k, i in enumerate(order):
            out[i] = flat[k]
        return out


def part_optimizer(tx, tree: Callable, part: str, stacked: list, others: list,
                   opt_state, api: str) -> tuple[PartOptimizer, list]:
    """The :class:`PartOptimizer` for ``part`` and its state's leaves, from the full state."""
    args = (stacked, None) if part == "stacked" else (None, others)
    abstract = jax.eval_shape(tx.init, tree(*args))
    sub = jax.tree_util.tree_flatten_with_path(abstract)[0]
    full = dict(jax.tree_util.tree_flatten_with_path(opt_state)[0])
    missing = [jax.tree_util.keystr(path) for path, _ in sub if path not in full]
    if missing:
        raise ValueError(
            f"{api}: the optimizer's state for the pipelined layers is not part of the train "
            f"state's optimizer state (missing {missing[:3]}); use an optax transformation "
            "whose state maps over the parameters (sgd, momentum, adam, ...)"
        )
    layers = stacked[0].shape[0]
    mirrors = tuple(part == "stacked" and a.ndim >= 1 and a.shape[0] == layers
                    for _, a in sub)
    return (PartOptimizer(tx, tree, part, jax.tree.structure(abstract),
                          tuple(path for path, _ in sub), mirrors),
            [full[path] for path, _ in sub])


def replace_leaves(opt_state, new: dict):
    """``opt_state`` with the leaves at the key paths of ``new`` replaced."""
    return jax.tree_util.tree_map_with_path(lambda path, x: new.get(path, x), opt_state)

