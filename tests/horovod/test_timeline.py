"""hvd.start_timeline / stop_timeline write a jax.profiler trace in which Horovod's ops are
named horovod/<op>; inside a program the same names are the collectives' op_name metadata."""

import glob
import gzip
import json

import jax.numpy as jnp
import numpy as np

import parallax.horovod as hvd
from parallax.analysis import hlo


def test_the_timeline_names_horovods_ops(tmp_path):
    hvd.start_timeline(str(tmp_path))
    hvd.allreduce(np.ones(2, np.float32))
    hvd.broadcast(np.ones(2, np.float32), root_rank=0)
    hvd.stop_timeline()
    hvd.stop_timeline()  # a second stop is a no-op, as Horovod's
    files = glob.glob(str(tmp_path / "plugins/profile/*/*.trace.json.gz"))
    assert files
    events = json.loads(gzip.open(files[0]).read())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"horovod/allreduce", "horovod/broadcast"} <= names


def test_inside_a_program_the_collectives_carry_the_names():
    @hvd.jit
    def step(x):
        return hvd.allreduce(jnp.sum(x)), hvd.allgather(x)[0]

    found = hlo.collectives(step.lower(np.ones((8, 2), np.float32)).compile())
    names = {c.kind: c.op_name for c in found}
    assert "horovod/allreduce" in names["all-reduce"]
    assert "horovod/allgather" in names["all-gather"]
