"""PS-Lite's ``tests/test_kv_app.cc``, ported to Python with ``parallax.ps``, line for line.

    python examples/ported/pslite_test_kv_app.py                          # 2 servers, 2 workers
    python examples/ported/pslite_test_kv_app.py --num 1000 --repeat 10 --handle request

The original starts a PS-Lite job (``Start(0)``), makes every server a ``KVServer<float>``
with ``KVServerDefaultHandle`` (``store[key] += value``; a pull reads ``store[key]``), and
has every worker push its ``num`` keys (``kMaxKey / num * i + rank``: spread over every
server, disjoint between workers) with values ``rand() % 1000`` (seeded by ``rank + 7``)
``repeat`` times, waiting on the tenth-last timestamp to bound the requests in flight, wait
for all of them, pull, then ``PushPull`` the same values ``repeat`` times one after another,
and check that the pull read ``repeat x values`` and the last push-pull
``2 x repeat x values`` (``CHECK_LT`` on the mean absolute error). The port keeps that
flow. What changes:

- ``Start(0)`` / ``Finalize(0, true)``: ``px.ps.init_cluster()`` (a local Ray cluster on
  127.0.0.1; the scheduler's role is Ray's head) and ``store.shutdown()``. Servers are Ray
  actors of one ``px.ps.KVStore``; workers are Ray tasks started by ``px.ps.run_workers``
  (PS-Lite starts one process per node from the environment that ``tracker/dmlc_local.py``
  or ``tests/local.sh`` sets).
- ``KVServerDefaultHandle<float>``: the store's default, ``px.ps.SumHandle`` (``--handle
  default``), and, as a request-handle variant (``--handle request``), the same handle
  written as PS-Lite's ``ReqHandle`` (:class:`DefaultRequestHandle`: its own store, called
  with ``(meta, data, server)`` for every request). With ``--handle both`` (the default)
  the same servers run both, emptied in between (``store.reset``).
- ``kv.Push(keys, vals)`` / ``kv.Pull(keys, &rets)`` / ``kv.PushPull(keys, vals, &outs)``:
  ``worker.push`` / ``worker.pull`` / ``worker.push_pull``, whose ``wait`` returns the
  values instead of filling an output vector.
- ``CHECK_LT``: the worker returns its errors, the driver prints them and exits 1 when one
  is over 1e-5. Beside PS-Lite's closed form (``repeat x values``), each worker also
  applies the same pushes to a plain NumPy array in its own process (the one-process run of
  the same computation) and reports the largest difference from it.

References:
  dmlc/ps-lite, ``tests/test_kv_app.cc`` and ``include/ps/kv_app.h``
  (``KVServerDefaultHandle``); Li et al., "Scaling Distributed Machine Learning with the
  Parameter Server", OSDI 2014.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np


class DefaultRequestHandle:
    """``KVServerDefaultHandle`` as a request handle: a store of its own, ``+=`` on push.

    One copy lives in each server's process (each owns its key range). ``store`` maps a key
    to its value, as PS-Lite's ``std::unordered_map<Key, Val>``; a pull of a key never
    pushed reads 0, as ``operator[]`` does.
    """

    def __init__(self):
        self.store: dict[int, float] = {}

    def __call__(self, meta, data, server):
        import parallax.ps as ps

        del server
        keys = data.keys.tolist()
        if meta.push:
            for key, value in zip(keys, np.asarray(data.vals).tolist()):
                self.store[key] = self.store.get(key, 0.0) + value
        if meta.pull:
            vals = np.array([self.store.get(key, 0.0) for key in keys], np.float32)
            return ps.KVPairs(data.keys, vals)
        return None


def run_worker(kv, num: int, repeat: int) -> dict:
    """The worker of test_kv_app.cc: push ``repeat`` times, pull, push-pull ``repeat`` times."""
    import parallax.ps as ps

    # init
    rank = kv.rank
    rng = np.random.default_rng(rank + 7)  # srand(rank + 7)
    keys = np.uint64(ps.MAX_KEY // num) * np.arange(num, dtype=np.uint64) + np.uint64(rank)
    vals = rng.integers(0, 1000, num).astype(np.float32)  # rand() % 1000

    # push
    ts = []
    for i in range(repeat):
        ts.append(kv.push(keys, vals))

        # to avoid too frequency push, which leads huge memory usage
        if i > 10:
            kv.wait(ts[len(ts) - 10])
    for t in ts:
        kv.wait(t)

    # pull
    rets = kv.wait(kv.pull(keys))

    # pushpull
    outs = None
    for i in range(repeat):
        # PushPull on the same keys should be called serially
        outs = kv.wait(kv.push_pull(keys, vals))

    res = np.abs(rets - vals * repeat).sum()
    res2 = np.abs(outs - vals * 2 * repeat).sum()

    # The same pushes applied to one array in this process: the one-process run.
    plain = np.zeros(num, np.float32)
    for _ in range(repeat):
        plain += vals
    plain_rets = plain.copy()
    for _ in range(repeat):
        plain += vals
    return {"rank": rank, "error": float(res / repeat), "error2": float(res2 / (2 * repeat)),
            "vs_one_process": float(max(np.abs(rets - plain_rets).max(),
                                        np.abs(outs - plain).max()))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-servers", type=int, default=2)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--num", type=int, default=10000, help="keys per worker")
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--handle", choices=["default", "request", "both"], default="both")
    parser.add_argument("--address", default=None, help="a running Ray cluster to join")
    args = parser.parse_args(argv)

    import parallax.ps as ps

    # start system
    started = ps.init_cluster(args.address)
    failed = False
    handles = {"default": None, "request": DefaultRequestHandle()}
    names = ["default", "request"] if args.handle == "both" else [args.handle]
    # setup server nodes
    store = ps.KVStore(args.num_servers, handle=handles[names[0]], consistency="eventual",
                       num_workers=args.num_workers)
    for name in names:
        # the same server processes, emptied, with the other handle
        store.reset(handle=handles[name])
        # run worker nodes
        reports = ps.run_workers(store, run_worker, args.num, args.repeat)
        for r in reports:
            print(f"{name} handle, worker {r['rank']}: error: {r['error']}, {r['error2']}; "
                  f"max difference vs one process {r['vs_one_process']}", flush=True)
            failed |= not (r["error"] < 1e-5 and r["error2"] < 1e-5
                           and r["vs_one_process"] <= 1e-5)
    # stop system
    store.shutdown()
    if started:  # Ray was not up before this program: disconnect (and stop a local cluster)
        ps.shutdown_cluster()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
