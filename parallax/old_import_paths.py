"""Import paths and names from before rounds 3 and 4, kept working with a warning until
parallax 0.3, which removes them (:data:`REMOVED_IN`).

Round 3 moved plumbing out of the top level (``parallax.demo`` is now
``parallax.cli.demo``, ``parallax.analysis.roofline`` is ``parallax.planner.roofline``...);
round 4 made folders of prefix families (``parallax.strategies.context_ring`` is now
``parallax.strategies.context_parallel.ring``, ``parallax.planner.predicted_memory`` is
``parallax.planner.predicted.memory``, the tf.distribute modules went into
``parallax.tf.mirrored``, ``parallax.tf.input`` and ``parallax.tf.parameter_server``). The
table is :data:`MOVED`. A script or notebook written against an old path still runs:
importing it returns the module at its new path, under both names, and warns once with a
``DeprecationWarning`` that names the new path. Public names (``px.*``) did not move; the
few renamed ones (:data:`RENAMED`) answer under their old name, warned the same way.

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

REMOVED_IN = "parallax 0.3"  # the release that drops every old path and name below

MOVED = {
    "parallax.aux": "parallax.grad.aux_outputs",
    "parallax.batch": "parallax.step.batch",
    "parallax.context_binding": "parallax.context",
    "parallax.demo": "parallax.cli.demo",
    "parallax.finite": "parallax.finite_check",
    "parallax.guards": "parallax.step.boundary_checks",
    "parallax.lazy_names": "parallax.ray_cluster.lazy_names",
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
    "parallax.analysis.memory": "parallax.planner.predicted.zero",
    "parallax.analysis.plan_result": "parallax.planner.plan_result",
    "parallax.analysis.predicted_memory": "parallax.planner.predicted.memory",
    "parallax.analysis.predicted_traffic": "parallax.planner.predicted.traffic",
    "parallax.analysis.report": "parallax.planner.report",
    "parallax.analysis.roofline": "parallax.planner.roofline",
    "parallax.analysis.setting": "parallax.planner.setting",
    "parallax.models.layers": "parallax.nn.layers",
    "parallax.models.llama_layers": "parallax.nn.llama_layers",
    "parallax.models.moe": "parallax.nn.moe",
    "parallax.models.moe_config": "parallax.nn.moe_config",
    "parallax.models.moe_routing": "parallax.nn.moe_routing",
    "parallax.models.padding": "parallax.nn.padding",
    "parallax.models.rope": "parallax.nn.rope",
    "parallax.nn.gpt": "parallax.models.parallel_gpt",
    "parallax.pipeline.module_state": "parallax.pipeline.runtime.module_state",
    "parallax.pipeline.runtime.executed": "parallax.analysis.executed",
    "parallax.pipeline.settings": "parallax.pipeline.runtime.settings",
    "parallax.pipeline.schedules.rules": "parallax.pipeline.schedules.dependencies",
    "parallax.step.finite_check": "parallax.finite_check",
    # round 4: prefix families became folders
    "parallax.strategies.context": "parallax.strategies.context_parallel.strategy",
    "parallax.strategies.context_groups": "parallax.strategies.context_parallel.stage_groups",
    "parallax.strategies.context_ring": "parallax.strategies.context_parallel.ring",
    "parallax.strategies.context_zigzag": "parallax.strategies.context_parallel.zigzag",
    "parallax.planner.pipeline_memory": "parallax.planner.predicted.pipeline",
    "parallax.planner.predicted_context": "parallax.planner.predicted.context_parallel",
    "parallax.planner.predicted_expert": "parallax.planner.predicted.expert_parallel",
    "parallax.planner.predicted_memory": "parallax.planner.predicted.memory",
    "parallax.planner.predicted_traffic": "parallax.planner.predicted.traffic",
    "parallax.planner.zero_memory": "parallax.planner.predicted.zero",
    # round 4: Ray's start-up and lazy names, shared by ps, rpc and tf, left ps
    "parallax.ps.cluster": "parallax.ray_cluster.connect",
    "parallax.ps.lazy_names": "parallax.ray_cluster.lazy_names",
    # round 4: one eager path for Horovod's collectives, a process set's or every process's
    "parallax.horovod.set_programs": "parallax.horovod.eager",
    # round 4: tf.distribute's families in folders (parallax.tf.mirrored and
    # parallax.tf.parameter_server are now their folders, re-exporting the strategy)
    "parallax.tf.auto_shard": "parallax.tf.input.auto_shard",
    "parallax.tf.cluster_resolver": "parallax.tf.parameter_server.cluster_resolver",
    "parallax.tf.coordinator": "parallax.tf.parameter_server.coordinator",
    "parallax.tf.cross_device_ops": "parallax.tf.mirrored.cross_device_ops",
    "parallax.tf.distributed_input": "parallax.tf.input.distributed",
    "parallax.tf.embedding": "parallax.tf.parameter_server.embedding",
    "parallax.tf.extended": "parallax.tf.mirrored.extended",
    "parallax.tf.input_options": "parallax.tf.input.options",
    "parallax.tf.key_layout": "parallax.tf.parameter_server.key_layout",
    "parallax.tf.mirrored_check": "parallax.tf.mirrored.divergence",
    "parallax.tf.multi_worker": "parallax.tf.mirrored.multi_worker",
    "parallax.tf.one_device": "parallax.tf.mirrored.one_device",
    "parallax.tf.partial_batches": "parallax.tf.input.partial_batches",
    "parallax.tf.partitioners": "parallax.tf.parameter_server.partitioners",
    "parallax.tf.ps_variable": "parallax.tf.parameter_server.variable",
    "parallax.tf.remote_value": "parallax.tf.parameter_server.remote_value",
    "parallax.tf.replica_program": "parallax.tf.mirrored.replica_program",
    "parallax.tf.server_model": "parallax.tf.parameter_server.server_model",
    "parallax.tf.sharded_dataset": "parallax.tf.input.dataset",
    "parallax.tf.sharded_variable": "parallax.tf.parameter_server.sharded_variable",
    "parallax.tf.tf_config_resolver": "parallax.tf.parameter_server.tf_config_resolver",
    "parallax.tf.worker_actor": "parallax.tf.parameter_server.worker_actor",
    "parallax.tf.worker_input": "parallax.tf.input.workers",
}


class _Alias(importlib.abc.Loader):
    """Loads an old path as the module at its new path (the same object, not a copy)."""

    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        warnings.warn(f"{spec.name} moved to {self.new}: import it from there "
                      f"(the old path will be removed in {REMOVED_IN}).",
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


# Public names renamed ("Plan" is px.plan's alone; "profile" is px.profile's, the pipeline's
# measures layers) or moved to another module (a dotted new name is the full path):
# module -> {old: new}.
RENAMED = {
    "parallax.comm": {"bucket_plan": "pack_buckets"},
    "parallax.pipeline": {"Plan": "Partition", "profile": "profile_layers"},
    "parallax.pipeline.planning.profile": {"profile": "profile_layers"},
    "parallax.planner.predicted.traffic": {
        "bubble": "parallax.planner.predicted.compute.bubble",
        "flops": "parallax.planner.predicted.compute.flops",
        "hbm_bytes": "parallax.planner.predicted.compute.hbm_bytes",
    },
}


def renamed_names(module: str, namespace: dict):
    """A module ``__getattr__`` for ``module`` that answers a renamed name with the new one,
    and a moved submodule (``px.planner.zero_memory``) with the module at its new path,
    warning once per use with a ``DeprecationWarning`` (:data:`RENAMED`, :data:`MOVED`)."""
    renamed = RENAMED.get(module, {})

    def __getattr__(name: str):
        if name in renamed:
            new = renamed[name] if "." in renamed[name] else f"{module}.{renamed[name]}"
            warnings.warn(f"{module}.{name} is now {new} (the old name will be removed in "
                          f"{REMOVED_IN}).", DeprecationWarning, stacklevel=2)
            if "." not in renamed[name]:
                return namespace[renamed[name]]
            where, _, attr = new.rpartition(".")
            return getattr(importlib.import_module(where), attr)
        if f"{module}.{name}" in MOVED:  # the finder warns, naming the new path
            return importlib.import_module(f"{module}.{name}")
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


def install() -> None:
    """Adds the finder to ``sys.meta_path`` once (importing parallax twice adds nothing)."""
    if not any(isinstance(f, OldPathFinder) for f in sys.meta_path):
        sys.meta_path.append(OldPathFinder())
