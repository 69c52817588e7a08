"""Every Ray service parallax starts listens and talks on 127.0.0.1 only, even when ``ray`` is
imported first and the environment asks Ray for a cluster on the network.

The services run in a network namespace the test makes (``unshare -n``), whose ``lo`` also
carries 10.99.0.2/24 with a default route through it: an address a Ray that ignored
parallax's loopback switch would take as the machine's, while nothing can ever leave the
namespace. ``ss`` lists every socket of the services' processes. A control (the user's own
``ray.init()``) shows that the namespace does expose a cluster started without parallax, and
that parallax then warns, naming what listens.
"""

import json
import shutil
import subprocess
import sys

import pytest

from distributed.launching import ROOT, Started
from distributed.launching import test_env as launch_env

PROGRAM = ROOT / "tests" / "ray_cluster" / "programs" / "sealed_services.py"
ROUTABLE = "10.99.0.2"


def namespace_or_skip() -> None:
    missing = [tool for tool in ("unshare", "ip", "ss") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"needs {missing} (util-linux, iproute2)")
    made = subprocess.run(["unshare", "-n", "true"], capture_output=True, text=True)
    if made.returncode:
        pytest.skip(f"cannot make a network namespace here (unshare -n: "
                    f"{made.stderr.strip()}; needs root or CAP_SYS_ADMIN)")


def is_the_dashboards_cloud_probe(socket: dict) -> bool:
    """The one request Ray makes beyond loopback that parallax cannot switch off: its dashboard
    asks the cloud metadata address which cloud it runs on, once at start (a connection, never
    a listener; parallax/ray_cluster/loopback.py)."""
    return (socket["state"] != "LISTEN" and socket["peer"] == "169.254.169.254:80"
            and "ray/dashboard/dashboard.py" in socket["command"])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_service_listens_and_connects_on_loopback_only_after_import_ray():
    pytest.importorskip("ray")
    namespace_or_skip()
    setup = (f"ip link set lo up && ip addr add {ROUTABLE}/24 dev lo && "
             f"ip route add default via {ROUTABLE} dev lo && exec {sys.executable} {PROGRAM} "
             "rpc ps tf user")
    env = launch_env(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1",  # asks Ray for a networked node
                   RAY_ADDRESS=f"{ROUTABLE}:6379",  # and to join one: parallax starts its own
                   JAX_PLATFORMS="cpu")
    with Started(["unshare", "-n", "bash", "-c", setup], timeout=840, env=env) as program:
        done = program.finish()
    assert done.returncode == 0, done.stderr[-3000:]
    reports = {r["service"]: r for r in map(json.loads, done.stdout.splitlines())}
    assert sorted(reports) == ["ps", "rpc", "tf", "user"], done.stdout
    for service in ("rpc", "ps", "tf"):
        report = reports[service]
        assert any("gcs_server" in p for p in report["processes"]), report  # Ray was there
        assert report["sockets"] >= 5, report
        assert set(report["usage_stats"]) == {"0"}, report  # Ray's reports to its servers: off
        beyond = [s for s in report["exposed"] if not is_the_dashboards_cloud_probe(s)]
        assert beyond == [], (service, beyond)
    control = reports["user"]
    assert any(s["local"].startswith((ROUTABLE, f"[::ffff:{ROUTABLE}]", "*", "0.0.0.0"))
               for s in control["exposed"]), control  # the namespace does expose a plain Ray
    assert len(control["warnings"]) == 1, control
    assert control["warnings"][0].startswith(
        f"parallax: Ray was already initialised in this process on {ROUTABLE}, not 127.0.0.1: "
        f"its services, on {ROUTABLE}: listening here beyond loopback, "), control["warnings"]
    assert "gcs_server (pid" in control["warnings"][0]


@pytest.mark.parametrize("users_choice", [None, "1"])
def test_usage_statistics_are_off_while_ray_starts_unless_the_user_chose(monkeypatch,
                                                                        users_choice):
    pytest.importorskip("ray")
    import os

    from parallax.ray_cluster.loopback import loopback_only

    if users_choice is None:
        monkeypatch.delenv("RAY_USAGE_STATS_ENABLED", raising=False)
    else:
        monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", users_choice)
    with loopback_only():
        assert os.environ["RAY_USAGE_STATS_ENABLED"] == (users_choice or "0")
    assert os.environ.get("RAY_USAGE_STATS_ENABLED") == users_choice
