"""Saves step 1 (small), then step 2 (large, slow to write) of DIRECTORY; the test kills it.

    python kill_worker.py DIRECTORY

Prints "saving 2" just before the second save starts.
"""

import sys

import numpy as np

import parallax as px

ROWS = 2048  # step 2 holds ROWS x 8192 float32 (64 MiB): long enough to be killed mid-write


def small():
    return {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "step": np.int32(1)}


if __name__ == "__main__":
    directory = sys.argv[1]
    px.checkpoint.save(directory, small(), step=1, extra={"note": "complete"})
    big = np.random.default_rng(0).standard_normal((ROWS, 8192), np.float32)
    print("saving 2", flush=True)
    px.checkpoint.save(directory, {"w": big, "step": np.int32(2)}, step=2)
    print("saved 2", flush=True)
