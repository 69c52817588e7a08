"""Runs a TensorFlow parameter-server script on TensorFlow's own servers, in one process.

    unshare -rn sh -c 'ip link set lo up && python tf_cluster.py SCRIPT [ARGS...]'

Starts in-process ``tf.distribute.Server``s for the ``worker`` and ``ps`` tasks (as
TensorFlow's tutorial does with ``create_in_process_cluster``), sets ``TF_CONFIG`` for the
chief, and runs SCRIPT as ``__main__``; then prints ``RESULT`` and a JSON line of its
``losses`` (fetched), ``w`` and ``b`` (read) and the shards' devices. TensorFlow's gRPC servers
listen on every interface, so the test runs this inside a network namespace of its own
(``unshare -rn``), whose only interface is its loopback: nothing is reachable from outside.
"""

import json
import os
import runpy
import socket
import sys

import tensorflow as tf


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(script: str, argv: list[str]) -> None:
    workers = int(argv[argv.index("--num-workers") + 1]) if "--num-workers" in argv else 1
    ps = int(argv[argv.index("--num-ps") + 1]) if "--num-ps" in argv else 2
    cluster = {"chief": [f"localhost:{free_port()}"],
               "worker": [f"localhost:{free_port()}" for _ in range(workers)],
               "ps": [f"localhost:{free_port()}" for _ in range(ps)]}
    servers = [tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name=job,
                                    task_index=i, protocol="grpc", start=True)
               for job in ("worker", "ps") for i in range(len(cluster[job]))]
    os.environ["TF_CONFIG"] = json.dumps({"cluster": cluster,
                                          "task": {"type": "chief", "index": 0}})
    sys.argv = [script, *argv]
    done = runpy.run_path(script, run_name="__main__")
    shards = done["shards"]
    print("RESULT", json.dumps({
        "losses": [float(loss.fetch()) for loss in done["losses"]],
        "w": done["w"].numpy().tolist(), "b": done["b"].numpy().tolist(),
        "devices": [v.device for v in shards(done["w"]) + shards(done["b"])],
        "replicas": done["strategy"].num_replicas_in_sync,
        "worker_devices": list(done["strategy"].extended.worker_devices),
        "parameter_devices": list(done["strategy"].extended.parameter_devices)}), flush=True)
    del servers
    os._exit(0)  # TensorFlow's servers never stop (Server.join blocks forever)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
