"""Every script in examples/ runs with ``--steps 2``; examples/README.md lists each one.

The ported scripts (examples/ported/) keep their originals' arguments and run with the
tiny settings of ``PORTED`` and their ``--check`` against one device or one process, which
makes a script exit non-zero on a mismatch. PS-Lite's port runs in this process on the
session's Ray cluster (a cluster of its own would cost seconds of start-up).

Single-process examples run in this test process (``runpy`` with a patched ``sys.argv``: the
8 simulated CPU devices and the compilation cache of the suite are already set up, so no
process pays JAX's start-up). Multi-process examples run under ``parallax launch -np 2``,
and the Ray ones in their own process (their local cluster stops with it); those start
together and are waited for together. An example not named below runs in process. An
example that a test elsewhere already runs, with a stronger check, is not run twice
(``COVERED``: the script and the test that runs it).
"""

import json
import os
import pathlib
import re
import runpy
import sys

import pytest

from tests.distributed.launching import Started

ROOT = pathlib.Path(__file__).parents[2]
EXAMPLES = ROOT / "examples"
LAUNCHED = {"multiprocess_dp_fsdp.py"}  # parallax launch -np 2
OWN_PROCESS = {"ps_async_train.py", "ps_embedding.py"}  # Ray: a local cluster of processes
COVERED = {  # run (and checked against one device) by these tests
    "horovod_train.py": "tests/horovod/programs/collectives.py",  # under parallax launch
    "resumable_train.py": "tests/checkpoint/test_example.py",  # stopped, resumed, bitwise
    "finetune_pretrained.py": "tests/examples/test_finetune_pretrained.py",  # resumed, --check
    "stock_cnn.py": "tests/byom/test_example.py",  # against a plain nnx loop
}
EXTRA = {"pipeline_schedules.py": ["--plot-dir", "{tmp}"],
         # px.metrics.Monitor's files, checked below: a log of each step and a trace
         "gradient_accumulation.py": ["--logdir", "{tmp}/logs", "--profile-steps", "2:3"],
         "llama_long_context.py": ["--check", "--seq-len", "64"],
         "zero_fsdp_big_model.py": ["--offload", "optimizer"]}  # + ZeRO-Offload's row
# A ported script: the launcher's flags ("in process": runpy here; "ray": runpy here, in the
# session's Ray cluster) and its arguments (tiny data, two ranks, a few steps, the check on).
PORTED = {
    "ported/horovod_tensorflow2_mnist.py": (
        ["-np", "2"], ["--steps", "6", "--batch", "16", "--check",
                       "--checkpoint-dir", "{tmp}/checkpoints"]),
    "ported/torchrun_ddp.py": (
        ["--nproc-per-node", "2"], ["2", "1", "--dataset_size", "128", "--check",
                                    "--snapshot_path", "{tmp}/snapshot"]),
    "ported/pslite_test_kv_app.py": ("ray", ["--num", "1000", "--repeat", "12"]),
    "ported/tf_parameter_server_training.py": ("ray", ["--steps", "6", "--check"]),
    "ported/tf_custom_training.py": (
        "in process", ["--epochs", "1", "--train-size", "64", "--test-size", "32",
                       "--batch-per-replica", "4", "--check", "--checkpoint-dir", "{tmp}/ckpt"]),
}
SCRIPTS = sorted([p.name for p in EXAMPLES.glob("*.py")]
                 + [f"ported/{p.name}" for p in EXAMPLES.glob("ported/*.py")])
IN_PROCESS = [s for s in SCRIPTS if s not in LAUNCHED | OWN_PROCESS | set(COVERED)
              and PORTED.get(s, ("in process",))[0] == "in process"]
IN_RAY_SESSION = [s for s in SCRIPTS if PORTED.get(s, ("",))[0] == "ray"]


def argv(name: str, tmp: pathlib.Path) -> list[str]:
    if name in PORTED:
        return [a.format(tmp=tmp) for a in PORTED[name][1]]
    return ["--steps", "2"] + [a.format(tmp=tmp) for a in EXTRA.get(name, [])]


@pytest.mark.parametrize("name", sorted(COVERED))
def test_examples_run_elsewhere_are_run_there(name):
    assert name.removesuffix(".py") in (ROOT / COVERED[name]).read_text()


def test_the_readme_lists_every_example_once():
    text = (EXAMPLES / "README.md").read_text()
    listed = re.findall(r"^\| \[`((?:ported/)?\w+\.py)`\]", text, flags=re.M)
    assert sorted(listed) == SCRIPTS


def _run_here(name, tmp_path, monkeypatch, capsys) -> str:
    """Runs an example in this process; returns what it printed.

    What the script adds to the environment (TensorFlow's scripts set ``TF_CONFIG``) is
    taken out again afterwards, for the tests that run next in this process.
    """
    monkeypatch.setattr(sys, "argv", [str(EXAMPLES / name), *argv(name, tmp_path)])
    monkeypatch.chdir(tmp_path)  # anything an example writes by default lands here
    before = set(os.environ)
    try:
        runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    except SystemExit as exit_:
        assert exit_.code in (0, None), capsys.readouterr().out[-3000:]
    finally:
        for key in set(os.environ) - before:
            del os.environ[key]
    out = capsys.readouterr().out
    assert out
    return out


def _track(monkeypatch, cls, made: list) -> None:
    """Records every ``cls`` the example creates (to shut it down when it is done)."""
    init = cls.__init__

    def tracked(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(cls, "__init__", tracked)


@pytest.mark.slow
@pytest.mark.xdist_group("ray")
@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.parametrize("name", IN_RAY_SESSION)
def test_ray_example_runs_in_the_sessions_cluster(name, tmp_path, monkeypatch, capsys):
    """A script ported from TensorFlow leaves its coordinator and servers running, as its
    original does (they end with the process); here they end with the test."""
    import parallax as px

    made: list = []
    _track(monkeypatch, px.tf.ParameterServerStrategy, made)
    _track(monkeypatch, px.tf.ClusterCoordinator, made)
    try:
        assert "vs one process" in _run_here(name, tmp_path, monkeypatch, capsys)
    finally:
        for job in reversed(made):  # the coordinator before its strategy's servers
            job.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("name", IN_PROCESS)
def test_example_runs_in_process(name, tmp_path, monkeypatch, capsys):
    out = _run_here(name, tmp_path, monkeypatch, capsys)
    if "--logdir" in EXTRA.get(name, []):
        assert "steps measured" in out and "tokens/s per device" in out  # the final table
        log = (tmp_path / "logs/metrics.jsonl").read_text()
        rows = [json.loads(line) for line in log.splitlines()]
        assert [r["step"] for r in rows] == [1, 2] and all(r["mfu"] > 0 for r in rows)
        assert list(tmp_path.glob("logs/plugins/profile/*/perfetto_trace.json.gz"))


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if "xla_force_host_platform_device_count" not in f)
    return env


@pytest.mark.slow
@pytest.mark.timeout(900)  # the scripts' own deadline is 600 s (launching.Started)
def test_multi_process_and_ray_examples_run(tmp_path):
    ported = {name for name, (launch, _) in PORTED.items() if isinstance(launch, list)}
    names = sorted(((LAUNCHED | OWN_PROCESS) & set(SCRIPTS)) | ported)
    started = {}
    for name in names:
        script = [sys.executable, str(EXAMPLES / name), *argv(name, tmp_path / name)]
        launch = PORTED[name][0] if name in PORTED else ["-np", "2"] if name in LAUNCHED else None
        if launch is not None:
            script = [sys.executable, "-m", "parallax.cli", "launch", *launch, *script]
        started[name] = Started(script, timeout=600, cwd=tmp_path, env=_env(),
                                merge_stderr=True)
    failed = {}
    for name, proc in started.items():
        try:
            done = proc.finish()
        except AssertionError as late:  # killed, with what it started, at its deadline
            failed[name] = str(late)[-3000:]
            continue
        if done.returncode != 0 or (name in ported and "vs one" not in done.stdout):
            failed[name] = done.stdout[-3000:]  # a ported script prints its comparison
    assert not failed, "\n\n".join(f"{k}:\n{v}" for k, v in failed.items())
