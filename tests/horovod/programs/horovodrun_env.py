"""Started as ``horovodrun --gloo -np N`` starts a slot (HOROVOD_* variables, no
``parallax launch``): joins the job, then prints what it sees.

    HOROVOD_RANK=r HOROVOD_SIZE=N ... python horovodrun_env.py
"""

import parallax.horovod as hvd

hvd.init()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from parallax.distributed import runtime  # noqa: E402

total = hvd.allreduce(np.float32(hvd.rank() + 1), op=hvd.Sum)
print(f"source {runtime.joined().source} processes {jax.process_count()} size {hvd.size()} "
      f"rank {hvd.rank()} sum {float(total):g}", flush=True)
hvd.shutdown()
