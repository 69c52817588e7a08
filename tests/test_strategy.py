import dataclasses

import pytest

import parallax as px


def test_strategies_are_immutable_values():
    s = px.DataParallel("data")
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.batch_axes = ("fsdp",)
    assert px.DataParallel("data") == px.DataParallel("data")


def test_compose_merges_rules_and_batch_axes_in_mesh_order():
    s = px.compose(px.TensorParallel("tensor"), px.ZeRO(3, "fsdp"), px.DataParallel("data"))
    assert s.batch_axes == ("data", "fsdp")
    assert s.zero_stage == 3 and s.shard_axis == "fsdp"
    assert dict(s.rules) == {"heads": "tensor", "kv_heads": "tensor", "mlp": "tensor",
                             "vocab": "tensor"}
    assert s.activation_rules["batch"] == ("data", "fsdp")
    assert s.name == "TensorParallel('tensor') + ZeRO(3, 'fsdp') + DataParallel('data')"


def test_presets_are_compositions():
    assert px.HSDP() == px.compose(px.DataParallel("data"), px.ZeRO(3, "fsdp"))
    assert px.FSDP("fsdp") == px.ZeRO(3, "fsdp")
    assert px.compose() == px.Strategy()


def test_sequence_parallel_adds_the_sequence_rule():
    assert dict(px.TensorParallel(sequence_parallel=True).rules)["sequence"] == "tensor"


def test_conflicting_rules_are_an_error():
    other = px.Strategy(name="Custom()", rules=(("mlp", "fsdp"),))
    with pytest.raises(
        ValueError,
        match=r"px.compose: conflicting rules for logical axis 'mlp': TensorParallel\('tensor'\) "
        r"maps it to 'tensor' and Custom\(\) maps it to 'fsdp'",
    ):
        px.compose(px.TensorParallel("tensor"), other)


def test_same_batch_axis_twice_is_an_error():
    with pytest.raises(ValueError, match=r"mesh axis 'data' splits the batch in both DataParallel\('data'\) and ZeRO\(1, 'data'\)"):
        px.compose(px.DataParallel("data"), px.ZeRO(1, "data"))


def test_batch_axis_used_for_a_rule_is_an_error():
    with pytest.raises(ValueError, match=r"mesh axis 'tensor' splits the batch in DataParallel\('tensor'\) and shards logical axis 'heads'"):
        px.compose(px.DataParallel("tensor"), px.TensorParallel("tensor"))


def test_two_zero_stages_and_two_producers_are_errors():
    with pytest.raises(ValueError, match=r"two ZeRO strategies"):
        px.compose(px.ZeRO(1, "data"), px.ZeRO(3, "fsdp"))
    with pytest.raises(ValueError, match=r"both decide how gradients are produced"):
        px.compose(px.GradientAccumulation(2), px.GradientAccumulation(4))


def test_mixed_styles_are_an_error():
    with pytest.raises(ValueError, match=r"different sync styles \['explicit', 'gspmd'\]"):
        px.compose(px.DataParallel("data", style="gspmd"), px.ZeRO(2, "fsdp", style="explicit"))


def test_bad_arguments():
    with pytest.raises(TypeError, match=r"px.compose: expected Strategy values"):
        px.compose(px.DataParallel(), "fsdp")
    with pytest.raises(ValueError, match=r"px.ZeRO: stage=4 must be 1"):
        px.ZeRO(4)
    with pytest.raises(ValueError, match=r"px.DataParallel: style='auto' must be one of"):
        px.DataParallel(style="auto")
    with pytest.raises(ValueError, match=r"px.GradientAccumulation: microbatches=0 must be a positive int"):
        px.GradientAccumulation(0)


def test_strategy_axis_missing_from_mesh():
    mesh = px.make_mesh(data=8)
    with pytest.raises(
        ValueError,
        match=r"px.train_step: the strategy ZeRO\(3, 'fsdp'\) uses mesh axis 'fsdp', but the mesh "
        r"is data=8 \(8 cpu devices\); add fsdp=N \(or fsdp=1\) to px.make_mesh",
    ):
        px.train_step(mesh, px.FSDP("fsdp"))
