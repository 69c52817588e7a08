"""``parallax explain`` and ``parallax plan``: a reference model, explained or planned.

``--model`` takes the reference presets (``tiny``, ``small``, ``gpt2_124m``, ``gpt2_350m``,
``llama2_7b``, ``llama3_8b``, ``llama3_70b``, ``llama3_1b``) or sizes
(:mod:`parallax.cli.model_choice`); ``--strategy`` the demo's names (``dp``, ``fsdp``,
``zero1``-``zero3``, ``tp``, ``tp-sp`` joined with ``+``) plus ``pp`` (``pp-gpipe``,
``pp-1f1b``, ``pp-interleaved``) for a pipeline over ``--stages`` stages. Nothing is
allocated: the state and the batch are abstract (``jax.ShapeDtypeStruct``), so
``gpt2_350m`` explains on 8 simulated CPU devices. With ``--cluster`` (``dgx-h100``,
``dgx-a100``) and more ``--devices`` than are present, nothing is compiled either: the
predictions price every collective inside a node and across nodes, at any device count.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import jax

from parallax.cli import model_choice, presets
from parallax.planner import roofline
from parallax.planner.choose import plan
from parallax.planner.candidates import SearchSpace
from parallax.planner.explain import explain
from parallax.planner.topology import CLUSTERS
from parallax.grad.gradients import value_and_grad
from parallax.mesh import make_mesh
from parallax.models import GPTConfig, next_token_loss, next_token_stages
from parallax.step.spmd_step import train_step
from parallax.strategies import Pipeline
from parallax.strategy import compose

MODELS = model_choice.MODELS
PIPELINES = {"pp": "1f1b", "pp-1f1b": "1f1b", "pp-gpipe": "gpipe",
             "pp-interleaved": "interleaved_1f1b"}


def gpt_config(name: str, dtype: str = "float32") -> GPTConfig:
    """A reference preset by name, computing in ``dtype``.

    Example:
      >>> gpt_config("tiny", "bfloat16").dtype
      <class 'jax.numpy.bfloat16'>
    """
    return model_choice.config(name, dtype)


state_fn = model_choice.state_fn
abstract_batch = model_choice.abstract_batch


def parse_strategy(name: str, devices: int, tensor: int = 2, stages: int = 2,
                   microbatches: int | None = None):
    """``(mesh axis sizes, strategy, loss)`` for the demo's names plus ``pp`` parts.

    Example:
      >>> axes, strategy, loss = parse_strategy("dp+tp+pp", 8)
      >>> axes
      {'stage': 2, 'tensor': 2, 'data': 2}
    """
    parts = name.split("+")
    pipes = [p for p in parts if p in PIPELINES]
    rest = "+".join(p for p in parts if p not in PIPELINES)
    if len(pipes) > 1:
        raise ValueError(f"parallax: {name!r} names {len(pipes)} pipelines; keep one of "
                         f"{', '.join(PIPELINES)}.")
    stage = 1
    if pipes:
        stage = max(d for d in range(1, min(stages, devices) + 1) if devices % d == 0)
    axes, strategy = presets.parse(rest or "dp", tensor=tensor, devices=devices // stage)
    if not pipes:
        return axes, strategy, next_token_loss
    schedule = PIPELINES[pipes[0]]
    virtual = 2 if schedule == "interleaved_1f1b" else 1
    pipeline = Pipeline("stage", microbatches=microbatches or 2 * stage, schedule=schedule,
                        virtual_stages=virtual)
    if not rest and stage == devices:  # a pipeline alone over every device: no data axis
        return {"stage": stage}, pipeline, next_token_stages
    return {"stage": stage} | axes, compose(strategy, pipeline), next_token_stages


def run_explain(args) -> int:
    """``parallax explain``: the report of one configuration (predicted only with
    ``--cluster`` and more ``--devices`` than are present)."""
    config = model_choice.from_args(args)
    wanted = args.devices or jax.device_count()
    predicted = args.cluster is not None and wanted > jax.device_count()
    count = wanted if predicted else min(wanted, jax.device_count())
    axes, strategy, _ = parse_strategy(args.strategy, count, args.tensor, args.stages,
                                       args.microbatches)
    loss_fn = model_choice.stages(config) if _is_pipeline(strategy) else next_token_loss
    state = jax.eval_shape(model_choice.state_fn(config))
    batch = model_choice.abstract_batch(config, args.batch)
    if predicted:
        report = explain((axes, strategy), state, batch, config=config, chip=args.chip,
                         cluster=args.cluster, stages=model_choice.stages(config))
    else:
        mesh = make_mesh(**axes, devices=jax.devices()[: math.prod(axes.values())])

        @train_step(mesh, strategy)
        def step(state, batch):
            loss, grads = value_and_grad(loss_fn)(state.model, batch)
            return state.apply_gradients(grads), {"loss": loss}

        report = explain(step, state, batch, config=config, chip=args.chip, link=args.link,
                         cluster=args.cluster, stages=model_choice.stages(config))
    if args.json:
        print(json.dumps(report.as_dict(), indent=1, default=str))
    elif args.plain:
        print(report.text())
    else:
        report.print()
    return 0


def _is_pipeline(strategy) -> bool:
    return any(rule[0] == "layers" for rule in strategy.rules)


def run_plan(args) -> int:
    """``parallax plan``: the ranked table and the chosen configuration."""
    config = model_choice.from_args(args)
    space = None
    if args.cluster is None or args.max_tensor != 8 or args.max_stages is not None:
        base = (SearchSpace.for_cluster(CLUSTERS[args.cluster].devices_per_node)
                if args.cluster else SearchSpace())
        space = dataclasses.replace(base, max_tensor=args.max_tensor,
                                    max_stages=args.max_stages or base.max_stages)
    result = plan(model_choice.state_fn(config), model_choice.stages(config),
                  model_choice.abstract_batch(config, args.batch),
                  devices=args.devices or jax.device_count(), memory_per_device=args.memory,
                  top_k=args.top, space=space, chip=args.chip, link=args.link,
                  exhaustive=args.exhaustive, cluster=args.cluster)
    print(result.table(args.rows))
    print(f"\nchosen: {result.best.candidate.label}  (mesh {dict(result.mesh.shape)}, "
          f"strategy {result.strategy.name})")
    if result.topology is not None and result.mesh.size >= result.topology.devices_per_node:
        ici, dcn = result.hybrid_axes()
        print(f"on {result.topology.name}: px.make_hybrid_mesh(ici={ici}, dcn={dcn})")
    return 0


def add_common(parser: argparse.ArgumentParser) -> None:
    model_choice.add_arguments(parser)
    parser.add_argument("--devices", type=int, default=None,
                        help="devices (simulated CPU devices when no accelerator; default 8); "
                             "with --cluster, any count: more than are present are predicted "
                             "without compiling or simulating them")
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--chip", default=None, choices=list(roofline.CHIPS),
                        help="the roofline's device (default: the devices' own, or the "
                             "cluster's); it implies its link (h100 -> nvlink-h100)")
    parser.add_argument("--link", default=None,
                        help="a parallax.comm.cost link preset (default: the chip's own)")
    parser.add_argument("--cluster", default=None, choices=list(CLUSTERS),
                        help="a cluster preset: devices per node, the link inside a node and "
                             "the network between nodes; prices each collective per level")


def add_explain_arguments(parser: argparse.ArgumentParser) -> None:
    add_common(parser)
    parser.add_argument("--strategy", default="dp+fsdp+tp",
                        help="parts joined by '+': dp, fsdp, zero1, zero2, zero3, tp, tp-sp, "
                             "and pp, pp-gpipe, pp-1f1b, pp-interleaved (default dp+fsdp+tp)")
    parser.add_argument("--tensor", type=int, default=2, help="tensor-parallel size")
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages (with pp)")
    parser.add_argument("--microbatches", type=int, default=None,
                        help="pipeline micro-batches (default 2 per stage)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--plain", action="store_true", help="plain text, not a rich table")


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    add_common(parser)
    parser.add_argument("--memory", type=float, default=None,
                        help="bytes per device (default: the devices' limit, the cluster "
                             "chip's memory with --cluster; none on CPU)")
    parser.add_argument("--top", type=int, default=4, help="candidates to compile")
    parser.add_argument("--max-tensor", type=int, default=8)
    parser.add_argument("--max-stages", type=int, default=None,
                        help="the most pipeline stages (default 8; 64 with --cluster)")
    parser.add_argument("--exhaustive", action="store_true",
                        help="compile every candidate (brute force)")
    parser.add_argument("--rows", type=int, default=15, help="rows of the table to print")
