"""A launched JAX program: joins the job and sums one row per process across the processes.

    parallax launch -np 2 -H localhost:1,127.0.0.1:1 python global_sum.py

Prints ``rank R of N: sum S`` (S = 0 + 1 + ... + N-1, computed by XLA's collective over
every process's devices) and ``pid P child P`` for the launcher tests' leftover check.
"""

import os

import parallax as px

px.distributed.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402

mesh = jax.make_mesh((jax.device_count(),), ("data",),
                     axis_types=(jax.sharding.AxisType.Auto,))
rows = np.full((jax.local_device_count(), 1), jax.process_index(), np.float32)
sharding = jax.sharding.NamedSharding(mesh, jax.P("data"))
total = jax.jit(lambda x: x.sum() / jax.local_device_count(),
                out_shardings=jax.sharding.NamedSharding(mesh, jax.P()))(
    jax.make_array_from_process_local_data(sharding, rows))
print(f"pid {os.getpid()} child {os.getpid()}", flush=True)
print(f"rank {jax.process_index()} of {jax.process_count()}: sum {float(total):g}", flush=True)
px.distributed.shutdown()
