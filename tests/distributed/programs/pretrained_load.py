"""Launched with 2 processes x 2 devices: a checkpoint loads into FSDP x TP, each process
reading only the slices its own devices hold.

    parallax launch -np 2 --devices-per-process 2 python pretrained_load.py DIR

DIR holds a GPT saved by ``px.models.save_pretrained``. Each process counts the bytes it
reads, compares its devices' shards with the file's tensors, saves the loaded model back
(gathered across processes, written by process 0) and prints one ``loaded`` line.
"""

import json
import sys

import parallax as px

px.distributed.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from parallax import layout  # noqa: E402
from parallax.models.pretrained import checkpoint_files  # noqa: E402

path = sys.argv[1]
read = checkpoint_files.CheckpointFiles.read
counted = []


def counting(self, name, index=None):
    array = read(self, name, index)
    counted.append(array.nbytes)
    return array


checkpoint_files.CheckpointFiles.read = counting
mesh = px.make_mesh(fsdp=2, tensor=2)  # fsdp spans the processes, tensor is inside each
model = px.models.from_pretrained(path, mesh=mesh, strategy=px.compose(
    px.FSDP("fsdp"), px.TensorParallel("tensor")))
checkpoint_files.CheckpointFiles.read = read

reference = px.models.from_pretrained(path)  # one device, whole tensors, to compare with
matches = True
whole = 0
for (key, leaf), ref in zip(jax.tree_util.tree_flatten_with_path(nnx.state(model))[0],
                            jax.tree.leaves(nnx.state(reference))):
    whole += ref.nbytes
    for shard in leaf.addressable_shards:
        matches &= bool(np.array_equal(np.asarray(shard.data), np.asarray(ref)[shard.index]))
px.models.save_pretrained(sys.argv[2], model)
print("loaded " + json.dumps({"process": jax.process_index(), "bytes_read": sum(counted),
                              "model_bytes": whole, "shards_match": matches}), flush=True)
px.distributed.shutdown()
