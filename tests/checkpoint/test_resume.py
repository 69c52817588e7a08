"""Bitwise resume: N steps straight equal N/2 steps, save, a NEW process, restore, N/2 steps.

Losses and final parameters are compared bit for bit, for DP x FSDP x TP and for a 1F1B
pipeline; the data sampler's position (a NumPy generator's state) travels in ``extra``.
"""

import os
import pathlib
import sys

import jax
import numpy as np
import pytest

import fixtures as fx
import parallax as px
from tests.distributed.launching import Started

from .ckpt_testing import RESUMABLE, WindowSampler, host, resumable, run

STEPS, BATCH = 4, 8
WORKER = pathlib.Path(__file__).parent / "programs" / "resume_worker.py"


def straight_run_saving_halfway(name, directory):
    """N steps in this process; the state after N/2 is saved (with the sampler's position)."""
    mesh, strategy, step = resumable(name)
    sampler = WindowSampler(BATCH)
    state, _ = run(step, px.init(fx.gpt_state, mesh, strategy),
                   [sampler.next() for _ in range(STEPS // 2)])
    px.checkpoint.save(directory, state, step=STEPS // 2,
                       extra={"data": sampler.state(), "batch": BATCH})
    return run(step, state, [sampler.next() for _ in range(STEPS - STEPS // 2)])


@pytest.mark.slow
def test_resume_in_a_new_process_is_bitwise(tmp_path):
    straight, jobs = {}, []
    for name in RESUMABLE:
        straight[name] = straight_run_saving_halfway(name, tmp_path / name)
        jobs += [name, str(tmp_path / name), str(tmp_path / f"{name}.npz")]
    done = Started([sys.executable, WORKER, STEPS, *jobs], timeout=300, cwd=None,
                   env=dict(os.environ)).finish()
    assert done.returncode == 0, done.stderr[-3000:]
    for name, (state, losses) in straight.items():
        resumed = np.load(tmp_path / f"{name}.npz")
        np.testing.assert_array_equal(resumed["losses"], losses, err_msg=name)
        assert int(resumed["step"]) == STEPS == int(state.step)
        for i, leaf in enumerate(jax.tree.leaves(host(state.params))):
            np.testing.assert_array_equal(resumed[f"p{i}"], leaf, err_msg=f"{name} leaf {i}")
