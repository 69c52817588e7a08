"""A launched program that reports where it runs (plain Python: starts in milliseconds).

    python rank_env.py [ARG ...] [--grow HOSTFILE]

Prints one line ``env {...}``: its pid, working directory, arguments and the launch
variables it was given. With ``--grow HOSTFILE`` (a discovery script's source), the first
start writes ``localhost:2`` there and waits to be stopped; a start with 2 processes exits 0.
"""

import json
import os
import sys
import time

NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
         "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
         "PARALLAX_COORDINATOR", "PARALLAX_NODE_RANK", "PARALLAX_NUM_NODES", "PARALLAX_RESTART",
         "PARALLAX_TEST_MARK")
seen = {name: os.environ.get(name) for name in NAMES}
seen.update(pid=os.getpid(), cwd=os.getcwd(), argv=sys.argv[1:], python=sys.executable)
print("env " + json.dumps(seen, sort_keys=True), flush=True)
if "--grow" in sys.argv:
    if os.environ["WORLD_SIZE"] == "2":
        sys.exit(0)
    if os.environ["RANK"] == "0":
        with open(sys.argv[sys.argv.index("--grow") + 1], "w") as f:
            f.write("localhost:2\n")
    time.sleep(60)
