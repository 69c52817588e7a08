"""Launched with 2 processes: rank 1 leaves with sys.exit(3) while rank 0 is blocked in a
collective that needs it. Without the launcher's handling, rank 1 would wait in JAX's
shutdown barrier and both would abort much later with a C++ stack trace."""

import os
import sys
import time

import parallax as px

px.distributed.initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

print(f"pid {os.getpid()}", flush=True)
mesh = px.make_mesh(data=-1)
total = jax.jit(jnp.sum)
for step in range(1000):
    batch = px.distributed.global_batch({"x": np.ones((1, 4), np.float32)}, mesh,
                                        px.DataParallel("data"))
    float(total(batch["x"]))
    if step == 2 and jax.process_index() == 1:
        print(f"fault at {time.time()}", flush=True)
        sys.exit(3)
    time.sleep(0.05)
