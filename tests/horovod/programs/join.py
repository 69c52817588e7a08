"""Launched with 2 processes of one device: uneven data with hvd.join (process 0 has 3
batches, process 1 has 1) with hvd.allreduce and with the eager hvd.DistributedOptimizer,
allgather_object, and an eager process set of rank 0 alone.

    parallax launch -np 2 python join.py

Prints ``sums [...] last N`` (the allreduce results this process saw and join's answer),
``optimizer [...] last N`` (the updates it applied),
``objects [...]`` and ``set ...``.
"""

import numpy as np
import optax

import parallax.horovod as hvd

hvd.init()

batches = [10.0, 20.0, 30.0] if hvd.rank() == 0 else [1.0]
sums, means = [], []
for b in batches:
    sums.append(float(hvd.allreduce(np.float32(b), op=hvd.Sum)))
    means.append(float(hvd.allreduce(np.float32(b))))
last = hvd.join()
print(f"sums {sums} means {means} last {last}", flush=True)
# the eager DistributedOptimizer under join: process 1 joins after one step, so process 0's
# next updates average its gradient with zeros (divided by size(), as Horovod's)
tx = hvd.DistributedOptimizer(optax.sgd(1.0))
params = {"w": np.zeros(2, np.float32), "b": np.zeros((), np.float32)}
state, steps = tx.init(params), []
for b in batches:
    updates, state = tx.update({"w": np.full(2, b, np.float32), "b": np.float32(-b)}, state,
                               params)
    steps.append([float(updates["w"][0]), float(updates["b"])])
print(f"optimizer {steps} last {hvd.join()}", flush=True)
print(f"objects {hvd.allgather_object({'rank': hvd.rank()})}", flush=True)
alone = hvd.add_process_set([0])
value = hvd.allreduce(np.float32(hvd.rank() + 5), op=hvd.Sum, process_set=alone)
print(f"set {float(value)} cross {hvd.cross_rank()} {hvd.cross_size()}", flush=True)
gathered = hvd.allgather(np.array([hvd.rank()]), process_set=alone)
parts = hvd.reducescatter(np.arange(4.0, dtype=np.float32) * (hvd.rank() + 1))
grouped = hvd.grouped_allreduce([np.float32(hvd.rank()), np.ones(2, np.float32)], op=hvd.Sum)
print(f"more {gathered.tolist()} {parts.tolist()} {[g.tolist() for g in grouped]}", flush=True)
hvd.shutdown()
