"""A launched script written for torchrun: it reads torchrun's variables and nothing else
(plain Python, as most data loaders and loggers do), then prints them.

    parallax launch -np 2 python torchrun_env.py
"""

import json
import os

NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
         "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR",
         "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
         "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE")
seen = {name: os.environ[name] for name in NAMES}  # a KeyError is the bug this catches
seen["PARALLAX_COORDINATOR"] = os.environ["PARALLAX_COORDINATOR"]
print("torchrun " + json.dumps(seen, sort_keys=True), flush=True)
