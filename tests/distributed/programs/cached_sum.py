"""A launched program for test_compilation_cache.py: one jitted sum over every device of 2
processes x 2 CPU devices (a gloo all-reduce), with the persistent compilation cache in the
directory the test names (``JAX_COMPILATION_CACHE_DIR``).

    parallax launch -np 2 --devices-per-process 2 python cached_sum.py [--jax-only | --jax-first]

With ``--jax-only`` it joins the job with ``jax.distributed.initialize`` itself (JAX alone,
what the cache does there); with ``--jax-first`` it does that and then calls
``px.distributed.initialize()`` too; with neither, only ``px.distributed.initialize()``. The
program takes long enough to compile (a loop of matmuls, unrolled) to be written to the
cache.
"""

import os
import sys
import time

import jax

if "--jax-only" in sys.argv or "--jax-first" in sys.argv:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", 2)
    jax.distributed.initialize(os.environ["PARALLAX_COORDINATOR"],
                               num_processes=int(os.environ["PARALLAX_NUM_PROCESSES"]),
                               process_id=int(os.environ["PARALLAX_PROCESS_ID"]),
                               heartbeat_timeout_seconds=10, shutdown_timeout_seconds=10)
if "--jax-only" not in sys.argv:
    import parallax as px

    px.distributed.initialize()

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

rank = jax.process_index()
mesh = jax.make_mesh((jax.device_count(),), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
rows = jax.sharding.NamedSharding(mesh, jax.P("d"))
x = jax.make_array_from_process_local_data(rows, np.full((2, 64), rank + 1, np.float32))


@jax.jit
def total(x):
    y = x
    for _ in range(20):
        y = jnp.tanh(y @ jnp.ones((64, 64), np.float32) / 64) + y
    return jnp.sum(x) + 0 * jnp.sum(y)


print(f"rank {rank}: cache {'on' if jax.config.jax_enable_compilation_cache else 'off'}",
      flush=True)
start = time.monotonic()
print(f"rank {rank}: sum {float(total(x))} in {time.monotonic() - start:.1f} s", flush=True)
