"""Import paths from before the core was grouped into rooms, kept working with a warning.

Round 3 moved plumbing out of the top level (``parallax.demo`` is now
``parallax.cli.demo``, ``parallax.analysis.roofline`` is ``parallax.planner.roofline``...;
the table is :data:`MOVED`). A script or notebook written against an old path still runs:
importing it returns the module at its new path, under both names, and warns once with a
``DeprecationWarning`` that names the new path. Public names (``px.*``) did not move.

Example:
  >>> import warnings, parallax
  >>> with warnings.catch_warnings():
  ...     warnings.simplefilter("ignore")  # the DeprecationWarning naming parallax.cli.demo
  ...     from parallax.demo import demo_tokens
  >>> demo_tokens.__module__
  'parallax.cli.demo'
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    "parallax.aux": "parallax.grad.aux_outputs",
    "parallax.batch": "parallax.step.batch",
    "parallax.context_binding": "parallax.context",
    "parallax.demo": "parallax.cli.demo",
    "parallax.finite": "parallax.step.finite_check",
    "parallax.guards": "parallax.step.boundary_checks",
    "parallax.lazy_names": "parallax.ps.lazy_names",
    "parallax.local_loss": "parallax.grad.slice_loss",
    "parallax.local_shards": "parallax.grad.local_shards",
    "parallax.microbatch": "parallax.grad.microbatches",
    "parallax.mutable": "parallax.grad.module_state",
    "parallax.presets": "parallax.cli.presets",
    "parallax.producer": "parallax.grad.producer",
    "parallax.rng": "parallax.grad.sliced_rng",
    "parallax.vma": "parallax.comm.varying",
    "parallax.analysis.auto": "parallax.planner.choose",
    "parallax.analysis.candidates": "parallax.planner.candidates",
    "parallax.analysis.commands": "parallax.cli.explain_and_plan",
    "parallax.analysis.explain": "parallax.planner.explain",
    "parallax.analysis.memory": "parallax.planner.zero_memory",
    "parallax.analysis.plan_result": "parallax.planner.plan_result",
    "parallax.analysis.predicted_memory": "parallax.planner.predicted_memory",
    "parallax.analysis.predicted_traffic": "parallax.planner.predicted_traffic",
    "parallax.analysis.report": "parallax.planner.report",
    "parallax.analysis.roofline": "parallax.planner.roofline",
    "parallax.analysis.setting": "parallax.planner.setting",
    "parallax.pipeline.runtime.executed": "parallax.analysis.executed",
    "parallax.pipeline.schedules.rules": "parallax.pipeline.schedules.dependencies",
    # round 4: prefix families became folders
    "parallax.strategies.context": "parallax.strategies.context_parallel.strategy",
    "parallax.strategies.context_groups": "parallax.strategies.context_parallel.stage_groups",
    "parallax.strategies.context_ring": "parallax.strategies.context_parallel.ring",
    "parallax.strategies.context_zigzag": "parallax.strategies.context_parallel.zigzag",
}


class _Alias(importlib.abc.Loader):
    """Loads an old path as the module at its new path (the same object, not a copy)."""

    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        warnings.warn(f"{spec.name} moved to {self.new}: import it from there "
                      f"(the old path will be removed in a later release).",
                      DeprecationWarning, stacklevel=2)
        return importlib.import_module(self.new)

    def exec_module(self, module):
        del module  # already executed under its new name


class OldPathFinder(importlib.abc.MetaPathFinder):
    """Finds the old paths of :data:`MOVED`, and nothing else."""

    def find_spec(self, name, path=None, target=None):
        del path, target
        if name not in MOVED:
            return None
        return importlib.util.spec_from_loader(name, _Alias(MOVED[name]))


# Public names renamed in round 3 ("Plan" is px.plan's alone): package -> {old: new}.
RENAMED = {
    "parallax.comm": {"bucket_plan": "pack_buckets"},
    "parallax.pipeline": {"Plan": "Partition"},
}


def renamed_names(package: str, namespace: dict):
    """A module ``__getattr__`` for ``package`` that answers a renamed name with the new one,
    warning once per use with a ``DeprecationWarning`` (the names of :data:`RENAMED`)."""
    renamed = RENAMED[package]

    def __getattr__(name: str):
        if name in renamed:
            warnings.warn(f"{package}.{name} is now {package}.{renamed[name]} (the old name "
                          f"will be removed in a later release).", DeprecationWarning,
                          stacklevel=2)
            return namespace[renamed[name]]
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


def install() -> None:
    """Adds the finder to ``sys.meta_path`` once (importing parallax twice adds nothing)."""
    if not any(isinstance(f, OldPathFinder) for f in sys.meta_path):
        sys.meta_path.append(OldPathFinder())
