"""A launched program for the launcher's fault tests (plain Python: starts in milliseconds).

    python faulty.py MODE [TARGET_RANK]

Every rank prints its pid and starts a grandchild (``sleep``) in its session, then waits.
With ``kill``, rank 0 ignores SIGTERM, so stopping it needs the launcher's SIGKILL. The target rank, after a
moment, does MODE: ``raise``, ``exit3`` (sys.exit(3)), ``kill`` (SIGKILL itself), ``wait``
(nothing: the test interrupts the launcher), ``restart`` (fails on the first start only) or
``ok`` (every rank exits 0).
"""

import os
import signal
import subprocess
import sys
import time

mode = sys.argv[1]
target = int(sys.argv[2]) if len(sys.argv) > 2 else 1
rank = int(os.environ["PARALLAX_PROCESS_ID"])
child = subprocess.Popen(["sleep", "60"])
print(f"pid {os.getpid()} child {child.pid} restart {os.environ['PARALLAX_RESTART']}", flush=True)
if rank == 0 and mode == "kill":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if mode == "ok" or (mode == "restart" and os.environ["PARALLAX_RESTART"] != "0"):
    child.kill()
    sys.exit(0)
if rank == target and mode != "wait":
    time.sleep(0.2)
    print(f"fault at {time.time()}", flush=True)
    if mode == "raise":
        raise RuntimeError(f"rank {rank} broke")
    if mode in ("exit3", "restart"):
        sys.exit(3)
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
time.sleep(60)
