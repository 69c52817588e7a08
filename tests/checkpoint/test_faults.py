"""Atomicity and faults: a killed save, mismatched trees, missing and damaged checkpoints.

A save interrupted by SIGKILL leaves the previous step restorable and the partial one
ignored; nothing a user had is ever deleted by a failed save; every error names what is
wrong and how to fix it (messages pinned).
"""

import os
import pathlib
import re
import shutil
import signal
import sys
import time

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import parallax as px
from parallax.checkpoint import CheckpointNotFoundError
from tests.distributed.launching import Started

from .programs.kill_worker import small

WORKER = pathlib.Path(__file__).parent / "programs" / "kill_worker.py"


def listing(directory):
    return sorted(str(p.relative_to(directory)) for p in pathlib.Path(directory).rglob("*"))


def user_files(directory):
    """A directory that already holds a user's files, which no save may touch."""
    directory = pathlib.Path(directory)
    (directory / "data").mkdir(parents=True)
    (directory / "notes.txt").write_text("mine")
    (directory / "data" / "tokens.bin").write_bytes(b"\x00\x01")
    return directory


def assert_user_files_intact(directory):
    assert (directory / "notes.txt").read_text() == "mine"
    assert (directory / "data" / "tokens.bin").read_bytes() == b"\x00\x01"


def like_small():
    return jax.eval_shape(small)


@pytest.mark.slow
def test_a_save_killed_midway_leaves_the_previous_step_and_is_ignored(tmp_path):
    directory = user_files(tmp_path / "ckpt")
    with Started([sys.executable, WORKER, directory], timeout=120, cwd=None,
                 env=dict(os.environ)) as child:
        assert next(child.lines()).strip() == "saving 2"
        deadline = time.monotonic() + 60
        while not list(directory.glob("2.orbax-checkpoint-tmp*")):
            assert time.monotonic() < deadline and child.proc.poll() is None, (
                "the save never started")
            time.sleep(0.002)
        os.kill(child.pid, signal.SIGKILL)  # mid-write: 64 MiB take far longer than a poll
        child.finish()
    assert child.returncode == -signal.SIGKILL
    assert not (directory / "2").exists()            # never committed
    assert list(directory.glob("2.orbax-checkpoint-tmp*"))  # the partial write is there ...

    restored = px.checkpoint.restore(directory, like=like_small)  # ... and ignored
    assert restored.step == 1 and restored.extra == {"note": "complete"}
    np.testing.assert_array_equal(restored.state["w"], small()["w"])
    with px.checkpoint.Manager(directory) as manager:
        assert manager.all_steps() == [1] and manager.latest_step() == 1
        assert manager.save(2, {"w": np.ones((3, 4), np.float32), "step": np.int32(2)})
    assert not list(directory.glob("*.orbax-checkpoint-tmp*"))  # a writer clears partial saves
    assert px.checkpoint.restore(directory, like=like_small).step == 2
    assert_user_files_intact(directory)


def mlp(hidden=8):
    return lambda: px.TrainState.create(px.models.MLP(4, [hidden], 4, rngs=nnx.Rngs(0)),
                                        optax.adam(1e-3))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = user_files(tmp_path_factory.mktemp("faults") / "ckpt")
    state = px.init(mlp(), px.make_mesh(data=8), px.FSDP("data"))
    px.checkpoint.save(directory, state, step=5, extra={"next_batch": 5})
    return directory, state


def test_a_tree_that_differs_from_like_names_the_path_and_both_shapes(saved):
    directory, _ = saved
    with pytest.raises(ValueError, match=re.escape(
            f"px.checkpoint.restore: the checkpoint {directory}/5 does not match `like` at "
            ".params['layers'][0]['bias'].value: the checkpoint holds float32[8], `like` "
            "expects float32[16]. Build `like` the way the saved state was built (same model "
            "sizes, same optimizer, same kind of state), or restore into that state and "
            "convert it.")):
        px.checkpoint.restore(directory, like=mlp(hidden=16))
    sgd = lambda: px.TrainState.create(px.models.MLP(4, [8], 4, rngs=nnx.Rngs(0)),  # noqa: E731
                                       optax.sgd(0.1))
    with pytest.raises(ValueError, match=re.escape(
            "does not match `like` at ['opt_state']['0']['count']: the checkpoint holds "
            "int32[], `like` expects nothing.")):
        px.checkpoint.restore(directory, like=sgd)
    functional = lambda: mlp()().params  # noqa: E731  (a bare parameter tree)
    with pytest.raises(ValueError, match=re.escape(
            "does not match `like` at ['layers'][0]['bias'].value: the checkpoint holds "
            "nothing, `like` expects float32[8].")):
        px.checkpoint.restore(directory, like=functional)


def test_a_checkpoint_of_the_unfused_model_layout_says_how_to_move_it(tmp_path):
    # px.models before fused projections kept query/key/value (and gate/up) kernels apart: a
    # state with that layout's leaf names, restored into today's fused GPT.
    old = {"blocks": {"attn": {"query": {"kernel": np.zeros((8, 2, 4), np.float32)},
                               "key": {"kernel": np.zeros((8, 2, 4), np.float32)}}}}
    directory = user_files(tmp_path / "ckpt")
    px.checkpoint.save(directory, old, step=1)
    new = {"blocks": {"attn": {"qkv": {"kernel": np.zeros((8, 3, 2, 4), np.float32)}}}}
    with pytest.raises(ValueError, match=re.escape(
            "The checkpoint holds px.models' layout from before fused projections "
            "(['blocks']['attn']['key']['kernel']: separate query/key/value kernels, or gate "
            "and up); this parallax keeps them fused (attn.qkv [D, 3, H, K] in the GPT, attn.key_value "
            "[D, 2, G, K] and mlp.gate_up [D, 2, F] in the Llama). Move the weights with "
            "px.models.save_pretrained in the parallax that saved it and "
            "px.models.from_pretrained here")):
        px.checkpoint.restore(directory, like=new)


def test_missing_directories_and_steps_are_clear(saved, tmp_path):
    directory, _ = saved
    with pytest.raises(CheckpointNotFoundError, match=re.escape(
            f"px.checkpoint.restore: no checkpoint directory {tmp_path}/nowhere: it does not "
            "exist. Pass the directory given to px.checkpoint.save or "
            "px.checkpoint.Manager.")) as missing:
        px.checkpoint.restore(tmp_path / "nowhere", like=mlp())
    assert isinstance(missing.value, FileNotFoundError) and isinstance(missing.value, ValueError)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError, match=re.escape(
            f"px.checkpoint.restore: no checkpoint in {tmp_path}/empty: it holds no complete "
            "step (a save that was interrupted leaves only a '<step>.orbax-checkpoint-tmp' "
            "directory, which is ignored).")):
        px.checkpoint.restore(tmp_path / "empty", like=mlp())
    with pytest.raises(CheckpointNotFoundError, match=re.escape(
            f"px.checkpoint.restore: no step 4 in {directory}; its steps are [5].")):
        px.checkpoint.restore(directory, like=mlp(), step=4)
    assert listing(tmp_path / "empty") == []  # a reader writes nothing


def damaged_copy(saved, tmp_path, damage):
    directory = tmp_path / "copy"
    shutil.copytree(saved[0], directory)
    damage(directory / "5" / "state")
    return directory


@pytest.mark.parametrize("damage", [
    lambda state: (state / "_METADATA").write_text("{not json"),
    lambda state: [p.write_bytes(b"garbage") for p in state.rglob("d/*") if p.is_file()],
    lambda state: shutil.rmtree(state),
], ids=["metadata", "data", "missing-item"])
def test_a_damaged_checkpoint_is_a_clear_error(saved, tmp_path, damage):
    directory = damaged_copy(saved, tmp_path, damage)
    with pytest.raises(ValueError, match=re.escape(
            f"px.checkpoint.restore: the checkpoint {directory}/5 cannot be read (")) as err:
        px.checkpoint.restore(directory, like=mlp())
    assert str(err.value).endswith(
        "it is damaged or incomplete. Restore another step of this directory (steps [5]) with "
        "step=..., or save it again.")


def test_a_failed_save_deletes_nothing(saved):
    directory, state = saved
    before = listing(directory)
    mesh, strategy = px.make_mesh(data=8), px.FSDP("data")
    donated = px.init(mlp(), mesh, strategy)
    step = px.train_step(mesh, strategy)(
        lambda s, b: (s.replace(step=s.step + 1), {}))
    step(donated, {"x": np.zeros((8, 4), np.float32)})  # donates the leaves of `donated`
    cases = [
        (lambda: px.checkpoint.save(directory, donated, step=6), ValueError,
         "px.checkpoint.save: the state's leaf .step was deleted: it was donated to a train "
         "step (px.train_step donates its state argument). Save the state the step returned."),
        (lambda: px.checkpoint.save(directory, state, step=5), ValueError,
         f"px.checkpoint.save: step 5 already exists in {directory}; a checkpoint is never "
         "overwritten. Save under another step, or delete that step directory yourself."),
        (lambda: px.checkpoint.save(directory, state, step=7, extra={"gen": np.random.default_rng()}),
         TypeError, "px.checkpoint.save: extra['gen'] is a Generator; extra holds JSON values"),
        (lambda: px.checkpoint.save(directory, state, step=7, extra={1: 2}), TypeError,
         "px.checkpoint.save: extra has the key 1 (int); keys of extra must be strings (JSON)."),
        (lambda: px.checkpoint.save(directory, {"w": "text"}, step=7), TypeError,
         "px.checkpoint.save: the state's leaf ['w'] is a str, not an array; a checkpoint holds "
         "arrays (jax.Array or numpy)."),
        (lambda: px.checkpoint.save(directory / "notes.txt", state, step=7), ValueError,
         f"px.checkpoint.save: {directory}/notes.txt is a file, not a directory"),
        (lambda: px.checkpoint.save(directory, state, step=-1), ValueError,
         "px.checkpoint.save: step must be >= 0, got -1."),
        (lambda: px.checkpoint.save(directory, state, step=True), TypeError,
         "px.checkpoint.save: step must be an int, got bool."),
    ]
    for call, kind, message in cases:
        with pytest.raises(kind, match=re.escape(message)):
            call()
        assert listing(directory) == before, message
    assert_user_files_intact(directory)
    assert px.checkpoint.restore(directory, like=mlp()).step == 5


def test_bad_restore_arguments(saved):
    directory, _ = saved
    mesh = px.make_mesh(data=8)
    cases = [
        (dict(like=mlp(), mesh="mesh"), TypeError,
         "px.checkpoint.restore: mesh must be a jax.sharding.Mesh (px.make_mesh) or None (one "
         "device), got str."),
        (dict(like=mlp(), strategy=px.FSDP("data")), ValueError,
         "px.checkpoint.restore: strategy=ZeRO(3, 'data') needs a mesh; pass "
         "mesh=px.make_mesh(...), or neither mesh nor strategy to restore on one device."),
        (dict(like=mlp(), mesh=mesh, strategy="fsdp"), TypeError,
         "px.checkpoint.restore: strategy must be a px.Strategy"),
        (dict(like=px.models.MLP(4, [8], 4, rngs=nnx.Rngs(0))), TypeError,
         "px.checkpoint.restore: like must be the function given to px.init (or an abstract "
         "state), not an nnx.Module (MLP)"),
        (dict(like={"w": "text"}), TypeError,
         "px.checkpoint.restore: like's leaf ['w'] is a str, not an array"),
        (dict(like=mlp(), step=2.0), TypeError, "px.checkpoint.restore: step must be an int"),
    ]
    for kwargs, kind, message in cases:
        with pytest.raises(kind, match=re.escape(message)):
            px.checkpoint.restore(directory, **kwargs)
    with pytest.raises(ValueError, match=re.escape(
            "px.checkpoint.Manager: max_to_keep must be >= 1, got 0.")):
        px.checkpoint.Manager(directory, max_to_keep=0)
    with pytest.raises(TypeError, match=re.escape(
            "px.checkpoint.Manager: save_every must be an int, got float.")):
        px.checkpoint.Manager(directory, save_every=2.5)
