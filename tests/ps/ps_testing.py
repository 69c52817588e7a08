"""Worker programs for the parameter-server tests (run in Ray worker processes)."""

import time

import jax
import numpy as np


def pslite_worker(worker, num_keys=1000, repeat=50):
    """PS-Lite's test_kv_app: push the same values ``repeat`` times, pull, compare."""
    keys = (np.uint64(np.iinfo(np.uint64).max // num_keys) * np.arange(num_keys, dtype=np.uint64)
            + np.uint64(worker.rank))
    values = np.random.default_rng(worker.rank + 7).integers(0, 1000, num_keys).astype(np.float32)
    stamps = []
    for i in range(repeat):
        stamps.append(worker.push(keys, values))
        if i > 10:
            worker.wait(stamps[-10])  # bounded memory, as PS-Lite's test does
    for stamp in stamps:
        worker.wait(stamp)
    pulled = worker.wait(worker.pull(keys))
    return float(np.abs(pulled - repeat * values).sum() / repeat)


def regression_worker(worker, x, y, steps, batch, delays):
    """Asynchronous SGD on least squares: pull w, gradient of a mini-batch, push it."""
    rng = np.random.default_rng(worker.rank)
    keys = np.arange(x.shape[1], dtype=np.uint64)
    for _ in range(steps):
        w = worker.wait(worker.pull(keys))
        rows = rng.integers(0, x.shape[0], batch)
        grad = x[rows].T @ (x[rows] @ w - y[rows]) / batch
        time.sleep(delays[worker.rank])
        worker.push(keys, grad.astype(np.float32))
    return worker.staleness


class FlatParams:
    """A parameter pytree as (sorted keys, lens, flat values), one key per leaf, spread over
    every server: leaf ``i`` goes to server ``i % n`` at key ``range.begin + i``."""

    def __init__(self, params, ranges):
        leaves, self.treedef = jax.tree.flatten(params)
        self.shapes = [np.shape(leaf) for leaf in leaves]
        raw = np.array([ranges[i % len(ranges)].begin + i for i in range(len(leaves))], np.uint64)
        self.order = np.argsort(raw)
        self.keys = raw[self.order]
        self.lens = np.array([int(np.prod(self.shapes[i])) for i in self.order], np.int64)

    def flatten(self, tree):
        leaves = jax.tree.leaves(tree)
        return np.concatenate([np.ravel(np.asarray(leaves[i], np.float32)) for i in self.order])

    def unflatten(self, flat):
        pieces = np.split(np.asarray(flat), np.cumsum(self.lens)[:-1])
        leaves = [None] * len(pieces)
        for piece, i in zip(pieces, self.order):
            leaves[i] = piece.reshape(self.shapes[i])
        return jax.tree.unflatten(self.treedef, leaves)


def least_squares(seed=0, rows=512, dim=8):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, dim)).astype(np.float32)
    w_star = rng.standard_normal(dim).astype(np.float32)
    return x, (x @ w_star).astype(np.float32), w_star


class RecordingHandle:
    """A PS-Lite request handle: sums pushes (cmd 0), scales by the pushed values (cmd 5),
    raises on negative pushed values, and answers pull cmd 9 with the metas it has seen."""

    def __init__(self):
        self.store, self.metas = {}, []

    def __call__(self, meta, data, server):
        import parallax.ps as ps

        self.metas.append(meta)
        if meta.push:
            if (np.asarray(data.vals) < 0).any():
                raise ValueError(f"negative value pushed with cmd {meta.cmd}")
            for key, value in zip(data.keys.tolist(), np.asarray(data.vals).tolist()):
                old = self.store.get(key, 0.0)
                self.store[key] = old * value if meta.cmd == 5 else old + value
        if not meta.pull:
            return None
        if meta.cmd == 9:  # a user command: one value per key, the number of requests seen
            vals = np.full(data.keys.size, len(self.metas), np.float32)
        else:
            vals = np.array([self.store.get(k, 0.0) for k in data.keys.tolist()], np.float32)
        server.response(meta, ps.KVPairs(data.keys, vals))
        return None


class SeenMetas:
    """A request handle that answers every pull with (cmd, push, pull, sender, timestamp)."""

    def __call__(self, meta, data, server):
        import parallax.ps as ps

        del server
        if meta.pull:
            row = [meta.cmd, meta.push, meta.pull, meta.sender, meta.timestamp,
                   meta.customer_id]
            return ps.KVPairs(data.keys, np.tile(np.array(row, np.float32), data.keys.size))
        return None


def exploding_sum_handle():
    """A simple handle whose push raises ZeroDivisionError('boom')."""
    import parallax.ps as ps

    class ExplodingSum(ps.SumHandle):
        def push(self, stored, pushed, state):
            raise ZeroDivisionError("boom")

    return ExplodingSum()


def echo_simple_handle(request, app):
    """A SimpleApp request handle: replies head:body:sender reversed; raises on head 13."""
    if request.head == 13:
        raise KeyError("unlucky head")
    app.response(request, f"{request.head}:{request.body[::-1]}:{request.sender}:{app.rank}")
