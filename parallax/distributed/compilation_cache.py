"""JAX's persistent compilation cache in a multi-process CPU job: turned off.

On CPU, JAX keys a cache entry by the process's own devices (the topology fingerprint
differs between processes) and only process 0 writes entries, so in a multi-process job
only process 0 ever finds its programs in the cache; every other process compiles them
again. With jax/jaxlib 0.12.1 a program that process 0 loads from the cache and a peer
compiles afresh never meet at their first gloo collective: both wait in gloo's all-reduce
forever (seen with a plain ``jax.distributed`` program of 2 processes x 2 CPU devices and
a ``psum``; 0.10.2 runs the same pair, and two processes that both load the program run
it too). A second run of any launched program whose step took longer than
``jax_persistent_cache_min_compile_time_secs`` to compile therefore hangs.

Since the cache never spares the other processes their compilation (and process 0 waits
for them at the first collective), turning it off in such a job costs nothing and makes
every run start the same way. :func:`parallax.distributed.initialize` does it for the
jobs it joins; accelerators (GPU, TPU) keep the cache, whose keys are the same in every
process there.

Example:
  >>> import jax
  >>> was = jax.config.jax_enable_compilation_cache
  >>> off_on_cpu(), jax.config.jax_enable_compilation_cache     # the tests' CPU devices
  (True, False)
  >>> jax.config.update("jax_enable_compilation_cache", was)
"""

from __future__ import annotations

import logging

import jax

logger = logging.getLogger(__name__)


def off_on_cpu() -> bool:
    """Turns the persistent compilation cache off when this job's devices are CPUs.

    Call it in every process of a multi-process job, after ``jax.distributed.initialize``
    and before the first compilation (the cache is looked up once per process, at the
    first compilation).

    Returns:
      True when the cache was on and this turned it off.
    """
    if jax.default_backend() != "cpu" or not jax.config.jax_enable_compilation_cache:
        return False
    jax.config.update("jax_enable_compilation_cache", False)
    logger.info("px.distributed: the persistent compilation cache is off in this "
                "multi-process CPU job (only process 0 would load programs from it, and with "
                "jax 0.12 a loaded program and a freshly compiled one hang at their first "
                "collective; see parallax.distributed.compilation_cache)")
    return True
