"""horovodrun's elastic mode: the hosts come from a discovery script, asked again and again.

What ``parallax launch --host-discovery-script S --min-np M [--max-np X]`` does:

- before each start it runs ``S`` (lines ``host:slots``, or ``host`` with
  ``--slots-per-host``) until the hosts have at least M slots, for at most
  ``--start-timeout`` seconds (then it stops with an error naming what S reported);
- it starts as many processes as there are slots, at most X (and at most ``-np`` on the
  first start), filling the hosts in order (:func:`parallax.distributed.hosts.place`);
- while the group runs it asks S every second; when S reports slots for more processes than
  run (up to X), it stops the group (SIGTERM) and starts it again, larger: the job grows
  back when hosts return. Such a restart is not a failure and does not count against
  ``--max-restarts``;
- a failure stops the group as always, and, up to ``--max-restarts`` times, the group starts
  again on the hosts S reports then (a host that is really gone is no longer reported).

Differences from Horovod: Horovod keeps its workers alive across a resize (they
re-rendezvous at the next ``state.commit()``), blacklists a failing host, and notifies
workers of new hosts so they finish the current step first. Here every resize is a restart
of the whole group from its last commit (``hvd.elastic.State``, ``parallax.checkpoint``):
the steps since that commit are run again, and commits must live in a ``directory=`` every
host can reach (no RAM directory is kept when ranks may run on other machines).

References:
  Horovod horovod/runner/elastic/driver.py (``ElasticDriver``: discovery every second,
  ``wait_for_available_slots``) and horovod/runner/elastic/discovery.py.
"""

from __future__ import annotations

import time

from parallax.distributed import hosts as hosts_lib
from parallax.distributed.coordinator_address import LaunchError

DISCOVERY_INTERVAL_S = 1.0


def wait_for_slots(config, log) -> tuple[hosts_lib.Host, ...]:
    """The hosts the script reports once they have ``config.min_np`` slots."""
    deadline = time.monotonic() + config.connect_timeout_s
    said = False
    while True:
        try:
            hosts, problem = hosts_lib.discover(config.discovery, config.slots_per_host), None
        except LaunchError as error:
            hosts, problem = (), str(error)
        if hosts_lib.total_slots(hosts) >= config.min_np:
            return hosts
        if time.monotonic() >= deadline:
            seen = ", ".join(f"{h.name}:{h.slots}" for h in hosts) or "no hosts"
            raise LaunchError(
                f"--host-discovery-script {config.discovery} reported {seen} "
                f"({hosts_lib.total_slots(hosts)} slots) for {config.connect_timeout_s:g} s, "
                f"fewer than --min-np {config.min_np}"
                + (f"; last error: {problem}" if problem else "")
                + ". Lower --min-np, or raise --start-timeout.")
        if not said:
            log(f"waiting for --min-np {config.min_np} slots from the discovery script")
            said = True
        time.sleep(DISCOVERY_INTERVAL_S)


def process_count(config, hosts, first: bool) -> int:
    """How many processes a start runs on ``hosts``."""
    count = hosts_lib.total_slots(hosts)
    if config.max_np is not None:
        count = min(count, config.max_np)
    if first and config.nproc:
        count = min(count, config.nproc)
    return count


def growth_watch(config, running: int):
    """A ``ProcessGroup.run`` watch: a reason to restart when more slots are reported."""

    def watch() -> str | None:
        try:
            hosts = hosts_lib.discover(config.discovery, config.slots_per_host)
        except LaunchError:
            return None  # a failing script does not stop a running job
        count = process_count(config, hosts, first=False)
        if count <= running:
            return None
        return (f"the discovery script reports {hosts_lib.total_slots(hosts)} slots "
                f"({', '.join(f'{h.name}:{h.slots}' for h in hosts)}); stopping the group of "
                f"{running} to start it again with {count}")

    return watch
