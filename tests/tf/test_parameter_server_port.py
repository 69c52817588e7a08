"""TensorFlow's own ParameterServerStrategy against the port, where TensorFlow is installed.

tests/tf/programs/tf_parameter_server_original.py runs on TensorFlow's servers (one worker,
two ps tasks, in one process: tf_cluster.py), inside a network namespace of its own
(``unshare -rn``: TensorFlow's gRPC servers listen on every interface, and the namespace's
only interface is its own loopback). examples/ported/tf_parameter_server_training.py runs
with the same arguments on the session's Ray cluster. For each partitioner TensorFlow's
scripts meet (FixedShardsPartitioner, MinSizePartitioner, none): the same losses and final
variables, the shards on the same servers, and the same ``num_replicas_in_sync`` and
``extended`` devices. And a ``tf.data`` pipeline built by a per-worker dataset function
reaches the scheduled function as numpy arrays.

Skipped where TensorFlow is not installed (it is not a dependency of parallax) or where a
network namespace cannot be made.
"""

import importlib.util
import json
import os
import pathlib
import runpy
import shutil
import subprocess
import sys

import numpy as np
import pytest

import parallax as px
from tests.distributed.launching import Started
from tf import ps_testing

ROOT = pathlib.Path(__file__).parents[2]
ORIGINAL = ROOT / "tests/tf/programs/tf_parameter_server_original.py"
PORT = ROOT / "examples/ported/tf_parameter_server_training.py"
PARTITIONERS = ("fixed", "min_size", "none")


def _namespaces_work() -> bool:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    done = subprocess.run(["unshare", "-rn", "sh", "-c", "ip link set lo up"],
                          capture_output=True, timeout=30)
    return done.returncode == 0


pytestmark = [
    pytest.mark.xdist_group("ray"), pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None,
                       reason="TensorFlow is not installed (a test-only peer)")]


@pytest.fixture(scope="module")
def tensorflows_runs():
    """TensorFlow's numbers for each partitioner (the three runs start together)."""
    if not _namespaces_work():
        pytest.skip("no network namespace (unshare -rn) to seal TensorFlow's servers in")
    started = {
        name: Started(["unshare", "-rn", "sh", "-c",
                       f"ip link set lo up && exec {sys.executable} tf_cluster.py "
                       f"{ORIGINAL.name} --steps 6 --partitioner {name}"],
                      timeout=600, cwd=ORIGINAL.parent, merge_stderr=True,
                      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
        for name in PARTITIONERS}
    results = {}
    for name, run in started.items():
        done = run.finish()
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        assert done.returncode == 0 and lines, done.stdout[-4000:]
        results[name] = json.loads(lines[-1].removeprefix("RESULT "))
    return results


def run_port(monkeypatch, partitioner: str) -> dict:
    """The port's globals after a run on the session's cluster (its jobs shut down after)."""
    made = []
    for cls in (px.tf.ParameterServerStrategy, px.tf.ClusterCoordinator):
        init = cls.__init__
        monkeypatch.setattr(cls, "__init__", lambda self, *a, _init=init, **k: (
            _init(self, *a, **k), made.append(self))[0])
    monkeypatch.setattr(sys, "argv", [str(PORT), "--steps", "6", "--partitioner", partitioner])
    monkeypatch.delenv("TF_CONFIG", raising=False)
    try:
        done = runpy.run_path(str(PORT), run_name="__main__")
        return {"losses": [float(loss.fetch()) for loss in done["losses"]],
                "w": done["w"].numpy(), "b": np.asarray(done["b"]),
                "devices": [v.device for v in done["w"].variables + done["b"].variables],
                "replicas": done["strategy"].num_replicas_in_sync,
                "worker_devices": list(done["strategy"].extended.worker_devices),
                "parameter_devices": list(done["strategy"].extended.parameter_devices)}
    finally:
        os.environ.pop("TF_CONFIG", None)
        for job in reversed(made):
            job.shutdown()


@pytest.mark.parametrize("partitioner", PARTITIONERS)
def test_the_port_trains_as_tensorflows_parameter_server_strategy(
        tensorflows_runs, ray_cluster, monkeypatch, partitioner):
    want, got = tensorflows_runs[partitioner], run_port(monkeypatch, partitioner)
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-6)
    for name in ("w", "b"):
        scale = np.max(np.abs(want[name]))
        assert np.max(np.abs(got[name] - np.asarray(want[name]))) <= 1e-5 * scale, name
    for key in ("devices", "replicas", "worker_devices", "parameter_devices"):
        assert got[key] == want[key], key


def test_a_tf_data_pipeline_reaches_the_scheduled_function_as_numpy(ray_cluster):
    strategy = px.tf.ParameterServerStrategy(px.tf.RayClusterResolver(num_workers=1, num_ps=1))
    coordinator = px.tf.ClusterCoordinator(strategy)
    try:
        def dataset_fn(input_context):  # built on the worker, as TensorFlow builds it
            import tensorflow as tf

            x = np.arange(12, dtype=np.float32).reshape(6, 2)
            batch = input_context.get_per_replica_batch_size(4)
            return tf.data.Dataset.from_tensor_slices((x, x[:, 0] > 4)).repeat().batch(batch)

        iterator = iter(coordinator.create_per_worker_dataset(
            lambda: strategy.distribute_datasets_from_function(dataset_fn)))
        got = [coordinator.schedule(ps_testing.next_element, args=(iterator,)).fetch()
               for _ in range(2)]
        x = np.arange(12, dtype=np.float32).reshape(6, 2)
        rows = [np.arange(4), np.arange(4, 8) % 6]  # repeat().batch(4)
        for (features, labels), index in zip(got, rows):
            assert isinstance(features, np.ndarray) and features.dtype == np.float32
            np.testing.assert_array_equal(features, x[index])
            np.testing.assert_array_equal(labels, x[index, 0] > 4)
    finally:
        coordinator.shutdown()
        strategy.shutdown()
