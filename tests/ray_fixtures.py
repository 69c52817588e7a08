"""One Ray cluster per test session, on 127.0.0.1, shut down at the end with nothing left over.

Ray tests are marked ``xdist_group("ray")`` so that pytest-xdist (``--dist loadgroup``) runs
them all in one process: the cluster starts once (about 5 s) and the CPU cost of its
processes is paid once. The cluster is small: 2 CPUs (servers and workers ask for none) and
a 128 MB object store. (pytest 9 ignores xdist's groups with pytest-xdist 3.8: the dev
extra keeps pytest 8, see docs/design.md.)
"""

import os
import time

import psutil
import pytest

RAY_PROCESS_NAMES = ("raylet", "gcs_server", "ray::", "plasma", "dashboard", "log_monitor")


def ray_children() -> list[psutil.Process]:
    """Ray's processes among this process's descendants."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            text = child.name() + " " + " ".join(child.cmdline())
        except psutil.Error:
            continue
        if any(name in text for name in RAY_PROCESS_NAMES):
            found.append(child)
    return found


@pytest.fixture(scope="session")
def ray_cluster():
    """Starts Ray on loopback for the session (or uses the one running) and stops it after."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    import parallax.ps

    started = parallax.ps.init_cluster(num_cpus=2, object_store_memory=128 << 20,
                                       log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()
        deadline = time.monotonic() + 15
        while ray_children() and time.monotonic() < deadline:
            time.sleep(0.2)
        leftovers = [(p.pid, p.name()) for p in ray_children()]
        assert not leftovers, f"Ray processes left after ray.shutdown(): {leftovers}"
