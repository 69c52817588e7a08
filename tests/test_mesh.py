import jax
import pytest
from jax.sharding import AxisType

import parallax as px
from parallax.mesh import axis_size, describe, hybrid_device_grid, resolve_axis_sizes


def test_axis_order_is_fixed_whatever_the_keyword_order():
    mesh = px.make_mesh(tensor=2, data=2, fsdp=2)
    assert mesh.axis_names == ("data", "fsdp", "tensor")
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}


def test_minus_one_fills_the_remaining_devices():
    mesh = px.make_mesh(stage=2, data=-1, tensor=2)
    assert dict(mesh.shape) == {"stage": 2, "data": 2, "tensor": 2}


def test_default_is_data_parallel_over_all_devices():
    assert dict(px.make_mesh().shape) == {"data": jax.device_count()}


def test_size_one_axes_are_kept_when_named():
    mesh = px.make_mesh(data=8, tensor=1)
    assert mesh.axis_names == ("data", "tensor")


def test_axis_types_are_explicit_and_chosen():
    assert px.make_mesh(data=8).axis_types == (AxisType.Auto,)
    assert px.make_mesh(data=8, axis_types="explicit").axis_types == (AxisType.Explicit,)


def test_devices_subset():
    mesh = px.make_mesh(data=2, tensor=2, devices=jax.devices()[:4])
    assert mesh.size == 4


def test_product_mismatch_prints_every_factor():
    with pytest.raises(
        ValueError,
        match=r"make_mesh: the axis sizes multiply to 12 \(data=3 x fsdp=4\) but there are 8 "
        r"devices; make the product equal 8, or set one axis to -1",
    ):
        px.make_mesh(data=3, fsdp=4)


def test_two_minus_ones_rejected():
    with pytest.raises(ValueError, match=r"make_mesh: at most one axis may be -1 .*data=-1 x tensor=-1"):
        px.make_mesh(data=-1, tensor=-1)


def test_minus_one_that_cannot_divide():
    with pytest.raises(ValueError, match=r"cannot fill data=-1: the other axes multiply to 3"):
        px.make_mesh(data=-1, tensor=3)


def test_unknown_axis_name():
    with pytest.raises(
        ValueError,
        match=r"make_mesh: unknown mesh axis 'model'; the axes are stage, data, fsdp, expert, context, sequence, tensor",
    ):
        px.make_mesh(model=8)


def test_bad_sizes():
    with pytest.raises(TypeError, match=r"axis data=2.0 must be an int"):
        px.make_mesh(data=2.0)
    with pytest.raises(ValueError, match=r"axis data=0 must be a positive size or -1"):
        px.make_mesh(data=0)
    with pytest.raises(ValueError, match=r"axis_types='manual' is not one of"):
        px.make_mesh(data=8, axis_types="manual")


def test_resolve_axis_sizes_and_helpers():
    assert resolve_axis_sizes("f", {"tensor": 2, "data": -1}, 8) == {"data": 4, "tensor": 2}
    mesh = px.make_mesh(data=4, tensor=2)
    assert axis_size(mesh, ("data", "tensor")) == 8 and axis_size(mesh, None) == 1
    assert describe(mesh) == "data=4 x tensor=2 (8 cpu devices)"


def test_hybrid_mesh_simulated_slices_keep_ici_axes_inside_a_slice():
    mesh = px.make_hybrid_mesh(ici={"fsdp": 2, "tensor": 2}, dcn={"data": 2})
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    ids = [[d.id for d in row.flat] for row in mesh.devices]
    # Each data index is one simulated slice of 4 consecutive devices.
    assert sorted(ids[0]) == [0, 1, 2, 3] and sorted(ids[1]) == [4, 5, 6, 7]


def test_hybrid_mesh_axis_with_both_parts():
    mesh = px.make_hybrid_mesh(ici={"data": 2, "tensor": 2}, dcn={"data": 2})
    assert dict(mesh.shape) == {"data": 4, "tensor": 2}
    # dcn is the outer factor of data: the first two data rows are slice 0.
    first_slice = {d.id for d in mesh.devices[:2].flat}
    assert first_slice == {0, 1, 2, 3}


class FakeDevice:
    """A device of a multi-slice machine (what JAX's mesh utilities read of one)."""

    platform = device_kind = "cpu"
    process_index = 0

    def __init__(self, id, slice_index):
        self.id, self.slice_index = id, slice_index


def test_real_slices_go_through_jax_mesh_utilities():
    # Two slices whose devices come interleaved: each data row must be one whole slice, as
    # JAX's create_hybrid_device_mesh lays them out (the path real multi-slice TPUs take).
    devices = [FakeDevice(i, i % 2) for i in range(8)]
    grid = hybrid_device_grid(devices, (1, 2, 2), (2, 1, 1))
    assert grid.shape == (2, 2, 2)
    assert [{d.slice_index for d in row.flat} for row in grid] == [{0}, {1}]
    assert sorted(d.id for d in grid[0].flat) == [0, 2, 4, 6]


def test_hybrid_mesh_errors():
    with pytest.raises(ValueError, match=r"8 devices do not split into 3 equal slices"):
        px.make_hybrid_mesh(ici={"tensor": -1}, dcn={"data": 3})
    with pytest.raises(ValueError, match=r"multiply to 4 \(tensor=4\) but there are 2 devices per slice"):
        px.make_hybrid_mesh(ici={"tensor": 4}, dcn={"data": 4})
    with pytest.raises(ValueError, match=r"dcn sizes must be explicit"):
        px.make_hybrid_mesh(ici={"tensor": 2}, dcn={"data": -1})
