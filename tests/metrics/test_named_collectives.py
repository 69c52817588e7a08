"""parallax names what it sends (jax.named_scope), so profiles show which strategy sent what."""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import parallax as px
from fixtures import mlp_batches, mlp_state, mlp_step
from parallax.analysis import hlo


def test_zero_gathers_and_gradient_syncs_are_named():
    mesh = px.make_mesh(data=2, fsdp=4)
    strategy = px.compose(px.DataParallel("data", style="explicit"), px.ZeRO(3, axis="fsdp"))
    state = px.init(mlp_state, mesh, strategy)
    program = mlp_step(mesh, strategy).lower(state, mlp_batches(1)[0]).compile()
    found = [c for c in hlo.collectives(program, mesh)
             if c.kind != "all-reduce" or c.message_bytes > 4]  # not the loss's mean
    assert {c.kind for c in found} >= {"all-gather", "reduce-scatter"}
    for c in found:
        expected = "parallax/zero_gather" if c.kind == "all-gather" else "parallax/grad_sync"
        assert expected in c.op_name, (c.kind, c.op_name)
    assert all(c.op_name.startswith("jit(step)/") for c in found)  # the user's step's name


def test_megatron_operators_are_named_forward_and_backward():
    mesh = px.make_mesh(tensor=8)

    def loss(x, w):
        def local(x, w):
            y = px.nn.reduce_from_tensor(px.nn.copy_to_tensor(x) @ w)  # f, matmul, g
            return jnp.sum(y ** 2)

        return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(None, "tensor")),
                             out_specs=P())(x, w)

    x, w = jnp.ones((4, 8)), jnp.ones((8, 16)) / 8
    with jax.set_mesh(mesh):
        program = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).compile()
    names = {c.op_name.split("parallax/")[-1].split("/")[0]
             for c in hlo.collectives(program, mesh) if "parallax/" in c.op_name}
    assert {"tensor_g", "tensor_f_grad"} <= names
