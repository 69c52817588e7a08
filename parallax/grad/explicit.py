"""``px.value_and_grad``'s explicit style: the data-parallel collectives written out.

Inside ``px.train_step``, with a strategy that splits the batch in the ``"explicit"`` style,
``px.value_and_grad`` opens a ``shard_map`` that is manual over the batch axes only (tensor
axes stay with GSPMD) and, in it:

1. ZeRO 3: each parameter shard is ``all_gather``-ed over the ZeRO axis;
2. every device computes the loss and gradients of its slice of the batch, with no
   communication (parameters are first cast to *varying* over the batch axes, so JAX's
   autodiff inserts no implicit ``psum``);
3. gradients are reduced: ``psum_scatter`` over the ZeRO axis for stages 2 and 3 (each
   device keeps the reduced slice it owns), then summed over the other batch axes by the
   strategy's ``grad_sync`` (e.g. DDP's buckets) or, without one, by the backend's choice
   (:mod:`parallax.grad.default_sync`: XLA's ``psum``, or parallax.comm's tree exchange
   across CPU processes), then divided by the number of batch shards. The loss is
   averaged the same way; auxiliary values, the module's state after the forward pass and
   sown values are reduced by kind (:mod:`parallax.grad.aux_outputs`).

The map checks varying axes (``check_vma``), which is what proves a loss, an aux value or
a module variable shared and keeps autodiff from inserting sums of its own. A
point-to-point sync's sums are equal on every device but typed varying, so they run in a
second ``shard_map`` of their own, unchecked, on the terms the first one returns
(:func:`summed_apart`); XLA compiles both into one program.

References:
  Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training",
  2020 (DDP's all-reduce of gradients); Rajbhandari et al., "ZeRO", 2020 (the all-gather
  and reduce-scatter of stages 2 and 3).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from parallax import context, layout
from parallax.comm.varying import to_varying
from parallax.grad.aux_outputs import join_examples, over_shards, split_examples
from parallax.grad.default_sync import AllReduceSync, chosen_sync
from parallax.grad.local_shards import auto_axes, group_on_local_shards, on_local_shards
from parallax.grad.module_state import Target
from parallax.grad.slice_loss import LocalResult, leading_size
from parallax.grad.sliced_rng import Position
from parallax.mesh import axis_size

API = "px.value_and_grad"


def explicit_value_and_grad(produce, parts: Target, batch, ctx, axes, source=None):
    """The explicit style: local gradients inside ``shard_map`` over ``axes``, then the
    data-parallel collectives, each a named step below. ``source`` (the module) names
    parameters a tensor-parallel plan lays out."""
    strategy, mesh = ctx.strategy, ctx.mesh
    shards = axis_size(mesh, axes)
    params = parts.params
    lays = layout.param_layouts(params, strategy, mesh, API, source=source)
    p_leaves, p_def = jax.tree.flatten(params)
    b_leaves, b_def = jax.tree.flatten(batch)
    sync = chosen_sync(strategy.grad_sync, mesh, axes)
    # A point-to-point sync's sums are equal on every device but typed varying, which JAX
    # cannot check: they run in a map of their own (summed_apart), after this checked one.
    apart = getattr(sync, "varying_results", False)

    float8 = strategy.float8
    fp8_kernels = float8.gathered_kernels(source) if float8 is not None else {}

    def body(p_local, state, b_local):
        with jax.named_scope("parallax/zero_gather"):  # names the collectives in profiles
            full = gather_params(p_local, lays, axes, float8, fp8_kernels)
        position = Position(lax.axis_index(axes), shards)
        with context.manual(axes):
            (loss, res), grads = produce(jax.tree.unflatten(p_def, full),
                                         jax.tree.unflatten(b_def, b_local), state, position)
        shared, examples = reduce_results(loss, res, leading_size(b_local), axes, shards)
        with jax.named_scope("parallax/grad_sync"):
            if apart:  # ZeRO's reduce-scatter here, the sum over the other axes apart
                return shared, examples, [g[None] for g in unsummed(
                    jax.tree.leaves(grads), lays, axes, strategy.precision)]
            synced = sync_grads(jax.tree.leaves(grads), lays, axes, sync, strategy.precision)
        return shared, examples, [g / shards for g in synced]

    b_spec = PartitionSpec(axes if len(axes) > 1 else axes[0])
    g_specs = [lay.manual_spec("grad", axes) for lay in lays]
    mapped = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=([lay.manual_spec("param", axes) for lay in lays], PartitionSpec(),
                  [b_spec] * len(b_leaves)),
        # Per-example values leave with the batch's spec: concatenated in batch order.
        out_specs=(PartitionSpec(), b_spec,
                   [stacked_spec(lay, axes) for lay in lays] if apart else g_specs),
        axis_names=frozenset(axes),
    )
    (loss, aux, new, state, checks), (aux_examples, new_examples), g_leaves = mapped(
        p_leaves, parts.state, b_leaves)
    if apart:
        g_leaves = summed_apart(g_leaves, lays, axes, sync, strategy.precision, mesh)
    result = LocalResult(join_examples(aux, aux_examples), state,
                         join_examples(new, new_examples), checks)
    return (loss, result), jax.tree.unflatten(p_def, g_leaves)


def stacked_spec(lay, axes) -> PartitionSpec:
    """The spec of a local gradient not yet summed, with a new leading dimension over the
    batch axes it is still to be summed over: each device's own term, in the checked map's
    types (varying over every batch axis)."""
    over = remaining_axes(lay, axes)
    lead = None if not over else over[0] if len(over) == 1 else over
    return PartitionSpec(lead, *lay.manual_spec("grad", axes))


def unsummed(leaves, lays, axes, policy=None):
    """Each local gradient in the precision policy's ``reduce`` dtype, after ZeRO's
    reduce-scatter: the terms a point-to-point sync sums."""
    if policy is not None:
        leaves = [g.astype(policy.reduce) for g in leaves]
    return [on_local_shards(scatter_grad, g, lay, axes) for g, lay in zip(leaves, lays)]


def summed_apart(stacked, lays, axes, grad_sync, policy, mesh):
    """The terms of :func:`unsummed` summed by a point-to-point ``grad_sync`` in a
    ``shard_map`` of its own, unchecked: its sums are equal on every device (both partners of
    an exchange add the same two numbers), typed varying, and leave replicated over the
    axes they were summed over. Only this map is unchecked: the step's map keeps JAX's
    checks of the loss, aux values, module state and autodiff. XLA sees one program, so each
    gradient's exchange still starts when the backward has produced it."""
    shards = axis_size(mesh, axes)

    def body(terms):
        summed = sync_groups([t[0] for t in terms], lays, axes, grad_sync)
        if policy is not None:
            summed = [g.astype(policy.grads) for g in summed]
        return [g / shards for g in summed]

    return jax.shard_map(body, mesh=mesh, in_specs=([stacked_spec(lay, axes) for lay in lays],),
                         out_specs=[lay.manual_spec("grad", axes) for lay in lays],
                         axis_names=frozenset(axes), check_vma=False)(list(stacked))


def reduce_results(loss, res: LocalResult, rows: int, axes, shards: int):
    """``(shared, examples)``: the loss, aux values, sown values, module state and checks
    of one shard reduced over the batch axes by kind (:mod:`parallax.grad.aux_outputs`), and the
    per-example values, which ``shard_map`` concatenates. The map checks varying axes, so a
    leaf invariant over the batch axes is known to be shared."""
    aux, aux_examples = split_examples(res.aux, rows, axes)
    new, new_examples = split_examples(res.new, rows, axes)
    checks = {name: lax.pmin(to_varying(ok.astype(jnp.int32), axes), axes) > 0
              for name, ok in res.checks.items()}
    shared = (mean_over(loss, axes, shards),
              over_shards(aux, axes, shards, api=API, what="auxiliary value"),
              over_shards(new, axes, shards, api=API, what="sown value"),
              over_shards(res.state, axes, shards, api=API, what="module variable"),
              checks)
    return shared, (aux_examples, new_examples)


def gather_params(leaves, lays, axes, float8=None, fp8_kernels=None):
    """Each parameter cast to varying over the batch axes (so autodiff inserts no implicit
    ``psum``) and, under ZeRO 3, all-gathered from its shards; the dense weights
    ``px.Float8`` names (``fp8_kernels``: path -> stacked dims) travel in float8."""
    fp8_kernels = fp8_kernels or {}

    def gather(x, lay):
        x = to_varying(x, axes)
        if not lay.is_sharded("param"):
            return x
        stacked = fp8_kernels.get(layout.dotted_key(lay.path))
        if stacked is not None:
            return float8.gather(x, lambda q: lay.zero.gather(q, lay.shard_dim),
                                 lay.zero.axis, stacked)
        return lay.zero.gather(x, lay.shard_dim)

    return [on_local_shards(gather, x, lay, axes) for x, lay in zip(leaves, lays)]


def scatter_grad(g, lay):
    """ZeRO 2/3: the gradient reduce-scattered over the ZeRO axis (each device keeps the
    summed slice it owns); unchanged otherwise."""
    return lay.zero.scatter(g, lay.shard_dim) if lay.is_sharded("grad") else g


def remaining_axes(lay, axes) -> tuple[str, ...]:
    """The batch axes a gradient is still to be summed over after ZeRO's reduce-scatter.

    Never an axis the rules split the leaf over (expert parallelism's experts): each
    device's shard holds other parameters, whose gradients already gathered every shard's
    tokens through the exchange's all-to-alls; they are summed only over the axes that
    replicate them."""
    split = lay.split_over(axes)
    axes = tuple(a for a in axes if a not in split)
    return tuple(a for a in axes if a != lay.zero.axis) if lay.is_sharded("grad") else axes


def sync_grads(leaves, lays, axes, grad_sync, policy=None):
    """Gradients summed over the batch axes: ZeRO's reduce-scatter, then one ``psum`` per
    leaf over the remaining axes (``grad_sync`` None or ``AllReduceSync("xla")``), or
    ``grad_sync`` per group (DDP buckets, point-to-point sums). With a precision policy the
    sum travels in its ``reduce`` dtype and comes back in its ``grads`` dtype."""
    if policy is not None:
        leaves = [g.astype(policy.reduce) for g in leaves]
        summed = sync_grads(leaves, lays, axes, grad_sync)
        return [g.astype(policy.grads) for g in summed]
    if grad_sync is None or grad_sync == AllReduceSync("xla"):
        def reduce(g, lay):
            g, over = scatter_grad(g, lay), remaining_axes(lay, axes)
            return lax.psum(g, over) if over else g

        return [on_local_shards(reduce, g, lay, axes) for g, lay in zip(leaves, lays)]
    leaves = [on_local_shards(scatter_grad, g, lay, axes) for g, lay in zip(leaves, lays)]
    return sync_groups(leaves, lays, axes, grad_sync)


def sync_groups(leaves, lays, axes, grad_sync):
    """``grad_sync`` once per group of leaves with the same axes still to sum over and the
    same automatic (TP) axes: a bucket must not mix leaves sharded over ``"tensor"`` with
    leaves replicated over it (``shard_map`` would refuse the replicated outputs)."""
    leaves = list(leaves)
    groups: dict[tuple, list[int]] = {}
    for i, lay in enumerate(lays):
        groups.setdefault((remaining_axes(lay, axes), auto_axes([lay], axes)), []).append(i)
    for (over, _), idx in groups.items():
        if over:
            summed = group_on_local_shards(lambda ls, over=over: grad_sync(ls, over),
                                           [leaves[i] for i in idx], [lays[i] for i in idx],
                                           axes)
            for i, g in zip(idx, summed):
                leaves[i] = g
    return leaves


def mean_over(x, axes, shards):
    """The loss averaged over the batch shards (a mean of equal shards' means)."""
    return lax.psum(x, axes) / shards
