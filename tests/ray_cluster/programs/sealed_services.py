"""Starts each of parallax's Ray services after ``import ray`` and reports every TCP socket of
this process tree that is not on 127.0.0.1 (``ss``), as one JSON line per service.

Run by tests/ray_cluster/test_loopback.py inside a network namespace of its own, whose ``lo``
has a second, routable-looking address and a default route: a Ray that ignored the loopback
switch would listen there. Services: ``rpc`` (``init_rpc``, three workers), ``ps``
(``KVStore``), ``tf`` (``ParameterServerStrategy`` and ``ClusterCoordinator``), and ``user``:
the user's own ``ray.init()`` first, then ``init_rpc`` (the control: exposed, and warned).

    python sealed_services.py rpc ps tf user
"""

import ray  # before parallax, on purpose: the order that used to expose the cluster

import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import numpy as np  # noqa: E402

LOOPBACK = ("127.0.0.1", "[::ffff:127.0.0.1]", "::ffff:127.0.0.1")


def host(address: str) -> str:
    return address.rsplit(":", 1)[0]


def sockets() -> list[dict]:
    """Every TCP socket in this network namespace (only this tree runs in it)."""
    out = subprocess.run(["ss", "-H", "-tanp"], capture_output=True, text=True,
                         check=True).stdout
    found = []
    for line in out.splitlines():
        fields = line.split()
        if len(fields) < 5:
            continue
        process = " ".join(fields[5:])
        found.append({"state": fields[0], "local": fields[3], "peer": fields[4],
                      "process": process, "command": command(process)})
    return found


def command(process: str) -> str:
    """The command line of the process ``ss`` names (``users:(("python",pid=7,fd=3))``)."""
    if "pid=" not in process:
        return ""
    pid = process.split("pid=", 1)[1].split(",", 1)[0]
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def dashboard_usage_stats() -> list[str]:
    """``RAY_USAGE_STATS_ENABLED`` as each Ray dashboard process of this namespace got it."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                if b"dashboard/dashboard.py" not in cmdline.read():
                    continue
            with open(f"/proc/{pid}/environ", "rb") as environ:
                variables = dict(item.split(b"=", 1) for item in environ.read().split(b"\0")
                                 if b"=" in item)
        except OSError:
            continue
        found.append(variables.get(b"RAY_USAGE_STATS_ENABLED", b"unset").decode())
    return found


def report(name: str, **extra) -> None:
    time.sleep(2)  # Ray's agents start a moment after ray.init returns
    every = sockets()
    exposed = [s for s in every if host(s["local"]) not in LOOPBACK
               or (s["state"] != "LISTEN" and host(s["peer"]) not in LOOPBACK)]
    print(json.dumps({"service": name, "sockets": len(every),
                      "usage_stats": dashboard_usage_stats(),
                      "processes": sorted({s["process"].split('"')[1] for s in every
                                           if '"' in s["process"]}),
                      "exposed": exposed, **extra}), flush=True)


def rpc() -> None:
    import parallax.rpc as rpc

    rpc.init_rpc("driver", rank=0, world_size=3)
    assert rpc.rpc_sync("worker1", max, args=(1, 2)) == 2
    report("rpc")
    rpc.shutdown()


def ps() -> None:
    import parallax as px

    px.ps.init_cluster()
    store = px.ps.KVStore(num_servers=1)
    worker, keys = store.worker(0), np.arange(3, dtype=np.uint64)
    worker.wait(worker.push(keys, np.ones(3, np.float32)))
    report("ps")
    store.shutdown()


def tf() -> None:
    import parallax as px

    strategy = px.tf.ParameterServerStrategy(px.tf.RayClusterResolver(num_workers=1, num_ps=1))
    coordinator = px.tf.ClusterCoordinator(strategy)
    assert coordinator.fetch(coordinator.schedule(np.add, args=(1, 2))) == 3
    report("tf")
    coordinator.shutdown()
    strategy.shutdown()


def user() -> None:
    os.environ.pop("RAY_ADDRESS", None)
    ray.init(include_dashboard=False)  # the user's own cluster, on the routable address
    import parallax.rpc as rpc

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rpc.init_rpc("driver", rank=0, world_size=2)
    report("user", warnings=[str(w.message) for w in caught
                             if type(w.message).__name__ == "ExposedClusterWarning"])
    rpc.shutdown()


if __name__ == "__main__":
    for service in sys.argv[1:]:
        globals()[service]()
        ray.shutdown()
