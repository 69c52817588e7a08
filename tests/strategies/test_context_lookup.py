"""parallax.attention.token_embeddings: the token lookup XLA 0.12 aborts on under context x
tensor parallelism, reproduced without parallax (in a subprocess: the abort kills the
process), and parallax's lookup in its place (same values, gradients and messages)."""

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import parallax as px
from parallax.analysis import hlo

# The explicit step's layout: a shard_map manual over data only; ids split over context
# (sequence), the table over tensor (vocabulary). "gspmd" leaves the lookup (or its
# gradient's scatter-add) to the partitioner; "parallax" does what ContextSplit.lookup does.
REPRO = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp
    from jax import P, shard_map
    jax.config.update("jax_num_cpu_devices", 8)
    op, how, length = sys.argv[1], sys.argv[2], int(sys.argv[3])
    mesh = jax.make_mesh((2, 2, 2), ("data", "context", "tensor"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 3)
    wsc, seq = jax.lax.with_sharding_constraint, P(None, "context")
    take = lambda t, i: jnp.take(t, i, axis=0)

    def lookup(table, ids):
        if how == "parallax":  # each device looks up its own ids, the table automatic
            return shard_map(take, in_specs=(P(), seq), out_specs=seq,
                             axis_names={"context"})(table, ids)
        return wsc(take(table, wsc(ids, seq)), seq)

    def table_gradient(table, ids):
        rows = wsc(jnp.ones(ids.shape + table.shape[1:]), seq)
        if how == "parallax":  # ids and rows whole over context before the scatter-add
            ids, rows = wsc(ids, P()), wsc(rows, P())
        else:
            ids = wsc(ids, seq)
        grad = wsc(jnp.zeros_like(table).at[ids].add(rows), P("tensor"))  # as the table
        return jax.lax.psum(grad, "data")

    body, out = (lookup, P("data")) if op == "gather" else (table_gradient, P())
    f = jax.jit(shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=out,
                          axis_names={"data"}))
    table = jax.ShapeDtypeStruct((256, 64), jnp.float32,
                                 sharding=jax.NamedSharding(mesh, P("tensor")))
    ids = jax.ShapeDtypeStruct((4, length), jnp.int32,
                               sharding=jax.NamedSharding(mesh, P("data")))
    f.lower(table, ids).compile()
    print("compiled")
""")
CHECK = "Check failed: partition_group_list.num_replica_groups()"
VERSION = jax.__version_info__[:3]
# op -> (jax versions that abort, a length it aborts at)
ABORTS = {
    "gather": (VERSION >= (0, 12), 128),  # from T = 128 (64 compiles); seen with 0.12.0.1
    "scatter": (VERSION >= (0, 12, 1), 64),  # at every length; 0.12.0.1 compiled it at 64
}


def run_repro(op: str, how: str, length: int):
    return subprocess.run([sys.executable, "-c", REPRO, op, how, str(length)],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("op", list(ABORTS))
def test_xla_aborts_on_the_lookup_left_to_gspmd_and_compiles_parallaxs(op):
    aborts, length = ABORTS[op]
    bad = run_repro(op, "gspmd", length)
    if aborts:
        assert bad.returncode != 0 and CHECK in bad.stderr, (bad.returncode,
                                                              bad.stderr[-2000:])
    else:  # jax 0.10.2 compiles it
        assert bad.returncode == 0 and bad.stdout.strip() == "compiled", bad.stderr[-2000:]
    good = run_repro(op, "parallax", length)
    assert good.returncode == 0 and good.stdout.strip() == "compiled", good.stderr[-2000:]


MESH_AXES = {"data": 2, "context": 2, "tensor": 2}
V, D, B, T = 64, 16, 4, 128  # T = 128: where XLA 0.12 aborted on jnp.take


class Lookup(nnx.Module):
    """A vocabulary-parallel table read by token_embeddings, as the models read theirs."""

    def __init__(self, rngs: nnx.Rngs):
        self.table = nnx.Param(jax.random.normal(rngs.params(), (V, D)),
                               out_sharding=("vocab", "embed"), eager_sharding=False)

    def __call__(self, tokens):
        rows = px.attention.token_embeddings(self.table[...], tokens)
        return px.constrain(rows, ("batch", "sequence", "embed"))


def lookup_loss(model, batch):
    """Weights each row by its global position (the sequence's order matters)."""
    rows = model(batch["tokens"])
    where = px.attention.sequence_positions(rows.shape[1])
    return jnp.mean(jnp.sin(rows) * where[None, :, None])


def make_state():
    return px.TrainState.create(Lookup(nnx.Rngs(0)), optax.sgd(0.1))


def three_d():
    mesh = px.make_mesh(devices=jax.devices()[:8], **MESH_AXES)
    strategy = px.compose(px.DataParallel("data"), px.ContextParallel("context"),
                          px.TensorParallel("tensor"))
    return mesh, strategy


def test_lookup_under_context_and_tensor_matches_one_device():
    rng = np.random.default_rng(0)
    batches = [{"tokens": rng.integers(0, V, (B, T)).astype(np.int32)} for _ in range(2)]
    mesh, strategy = three_d()
    par = px.testing.train(make_state, lookup_loss, batches, mesh=mesh, strategy=strategy)
    px.testing.assert_equivalent(par, px.testing.train(make_state, lookup_loss, batches),
                                 rtol=1e-5)


def test_lookup_sends_what_xla_0_10_chose():
    """The forward all-reduces each device's T/n rows over tensor (the vocabulary-parallel
    lookup); the backward all-gathers the ids and the rows' gradient over context, once each
    (the table's gradient is not summed over context; the loss, a scalar, is)."""
    mesh, strategy = three_d()

    @px.train_step(mesh, strategy)
    def step(state, batch):
        loss, grads = px.value_and_grad(lookup_loss)(state.model, batch)
        return state.apply_gradients(grads), loss

    batch = {"tokens": jax.ShapeDtypeStruct((B, T), jnp.int32)}
    found = hlo.collectives(step.lower(jax.eval_shape(make_state), batch).compile(), mesh)
    rows, n = B // MESH_AXES["data"], MESH_AXES["context"]
    shown = [(c.kind, c.axes, c.shapes) for c in found]
    assert [(c.kind, c.shapes) for c in found if c.axes == ("tensor",)] == [
        ("all-reduce", ((rows, T // n, D),))], shown
    assert sorted((c.kind, c.shapes) for c in found if c.axes == ("context",)) == [
        ("all-gather", ((rows, T),)), ("all-gather", ((rows, T, D),)),
        ("all-reduce", ((),))], shown
