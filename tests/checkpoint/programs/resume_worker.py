"""A fresh process that restores a checkpoint and finishes the run (for test_resume.py).

    python resume_worker.py TOTAL_STEPS CONFIG DIRECTORY OUT.npz [CONFIG DIRECTORY OUT.npz ...]

For each job: restores the latest step of DIRECTORY under CONFIG (ckpt_testing.RESUMABLE),
rebuilds the data sampler from the saved extra, trains to TOTAL_STEPS and writes the losses
and the final parameters to OUT.npz. One process serves every job (one start-up).
"""

import pathlib
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_default_matmul_precision", "highest")
TESTS = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(TESTS), str(TESTS / "checkpoint")]

import numpy as np  # noqa: E402

import fixtures as fx  # noqa: E402
import parallax as px  # noqa: E402
from ckpt_testing import WindowSampler, host, resumable, run  # noqa: E402


def main(name, directory, total, out):
    mesh, strategy, step = resumable(name)
    restored = px.checkpoint.restore(directory, like=fx.gpt_state, mesh=mesh, strategy=strategy)
    sampler = WindowSampler(restored.extra["batch"], state=restored.extra["data"])
    assert sampler.position == restored.step
    batches = [sampler.next() for _ in range(total - restored.step)]
    state, losses = run(step, restored.state, batches)
    leaves = jax.tree.leaves(host(state.params))
    np.savez(out, losses=losses, step=int(state.step), **{f"p{i}": x for i, x in enumerate(leaves)})


if __name__ == "__main__":
    jobs = sys.argv[2:]
    for i in range(0, len(jobs), 3):
        main(jobs[i], jobs[i + 1], int(sys.argv[1]), jobs[i + 2])
