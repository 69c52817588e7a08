import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import parallax as px
from parallax.rules import annotated_leaves, resolve_spec


def annotated(init, names):
    return nnx.with_partitioning(init, names, eager_sharding=False)


class Tiny(nnx.Module):
    def __init__(self, rngs):
        self.kernel = nnx.Param(annotated(nnx.initializers.ones, ("embed", "mlp"))(rngs.params(), (8, 16)))
        self.bias = nnx.Param(jnp.zeros(16))  # unannotated


@pytest.fixture(scope="module")
def mesh():
    return px.make_mesh(data=4, tensor=2)


def test_nnx_names_are_read_from_variable_metadata():
    state = nnx.state(Tiny(nnx.Rngs(0)), nnx.Param)
    by_path = {jax.tree_util.keystr(a.path): a.names for a in annotated_leaves(state)}
    assert by_path == {"['bias'].value": None, "['kernel'].value": ("embed", "mlp")}


def test_annotated_model_builds_without_a_mesh():
    # Eager sharding is off per variable, so no mesh context is needed.
    assert Tiny(nnx.Rngs(0)).kernel.shape == (8, 16)


def test_linen_logically_partitioned_boxes():
    class Dense(nn.Module):
        @nn.compact
        def __call__(self, x):
            k = self.param("kernel", nn.with_logical_partitioning(nn.initializers.ones, ("embed", "mlp")), (8, 16))
            return x @ k

    params = Dense().init(jax.random.key(0), jnp.ones((1, 8)))["params"]
    (leaf,) = annotated_leaves(params)
    assert leaf.names == ("embed", "mlp") and not leaf.physical


def test_linen_partitioned_boxes_are_mesh_axes(mesh):
    box = nn.Partitioned(jnp.ones((8, 16)), names=(None, "tensor"))
    (leaf,) = annotated_leaves({"w": box})
    assert leaf.physical
    assert resolve_spec(leaf.names, (8, 16), {}, mesh, physical=True) == P(None, "tensor")


def test_plain_pytree_has_no_names(mesh):
    (leaf,) = annotated_leaves({"w": jnp.ones((8, 16))})
    assert leaf.names is None
    assert resolve_spec(None, (8, 16), {"mlp": "tensor"}, mesh) == P(None, None)


def test_resolve_spec_maps_names_and_leaves_unknown_names_replicated(mesh):
    rules = {"mlp": "tensor", "batch": "data"}
    assert resolve_spec(("embed", "mlp"), (8, 16), rules, mesh) == P(None, "tensor")
    assert resolve_spec(("batch", "mlp"), (8, 16), rules, mesh) == P("data", "tensor")
    assert resolve_spec(("batch", "mlp"), (8, 16), {"batch": ("data", "tensor"), "mlp": "tensor"}, mesh) == P(("data", "tensor"), None)


def test_skip_axes_drop_manual_axes(mesh):
    assert resolve_spec(("batch", "mlp"), (8, 16), {"batch": "data", "mlp": "tensor"}, mesh,
                        skip_axes=frozenset({"data"})) == P(None, "tensor")


def test_indivisible_dimension_names_path_shape_axes_and_fix(mesh):
    with pytest.raises(
        ValueError,
        match=r"px.init: cannot shard \['layer'\]\['kernel'\] of shape \(8, 15\): dimension 1 "
        r"\('mlp', size 15\) maps to mesh axes tensor=2 \(2 shards\), and 15 is not divisible "
        r"by 2. Fix: make that dimension a multiple of 2 \(pad it\), or map 'mlp' to None",
    ):
        resolve_spec(("embed", "mlp"), (8, 15), {"mlp": "tensor"}, mesh, path="['layer']['kernel']", api="px.init")


def test_rank_mismatch_and_missing_mesh_axis(mesh):
    with pytest.raises(ValueError, match=r"has shape \(8,\) \(1 dimensions\) but its sharding annotation"):
        resolve_spec(("embed", "mlp"), (8,), {}, mesh)
    with pytest.raises(ValueError, match=r"maps to mesh axis 'fsdp', which the mesh does not have"):
        resolve_spec(("mlp",), (8,), {"mlp": "fsdp"}, mesh)


def test_constrain_is_identity_outside_a_step():
    x = jnp.ones((4, 8))
    assert px.constrain(x, ("batch", "embed")) is x


def test_constrain_inside_a_step_shards_activations(mesh):
    strategy = px.TensorParallel("tensor")

    @px.train_step(mesh, strategy, donate=False)
    def step(state, batch):
        h = px.constrain(batch["x"] @ state["w"], ("batch", "mlp"))
        return state, {"h": h}

    _, out = step({"w": jnp.ones((8, 16))}, {"x": jnp.ones((4, 8))})
    assert out["h"].sharding.spec == P(None, "tensor")
