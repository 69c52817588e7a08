"""PyTorch's distributed pipeline example on parallax.rpc: two model shards on two workers,
forward through RRefs, backward by distributed autograd, DistributedOptimizer; checked
against the same model trained in one process (parameters after every step).

    python examples/rpc/pipeline.py --steps 3
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax

import parallax.rpc as rpc
from parallax.rpc import dist_autograd


class Shard:
    """One stage of the model, living on its worker; its parameters are an RRef there."""

    def __init__(self, w):
        self.w = rpc.RRef(np.asarray(w))

    def parameter_rrefs(self):
        return [self.w]

    def forward(self, x):
        return jnp.tanh(x @ self.w.local_value())


def mse(y, target):
    return jnp.mean((y - target) ** 2)


def one_process_loss(params, x, target):
    return mse(jnp.tanh(jnp.tanh(x @ params[0]) @ params[1]), target)


def main(steps: int = 3) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 8)).astype(np.float32)
    target = rng.normal(size=(16, 4)).astype(np.float32)
    w = [(rng.normal(size=s) / 3).astype(np.float32) for s in [(8, 16), (16, 4)]]
    tx = optax.adam(0.05)

    rpc.init_rpc("master", rank=0, world_size=3)
    shards = [rpc.remote(f"worker{i + 1}", Shard, args=(w[i],)) for i in range(2)]
    params = [r for s in shards for r in s.rpc_sync().parameter_rrefs()]
    optimizer = rpc.DistributedOptimizer(tx, params)
    plain, state = [jnp.asarray(v) for v in w], tx.init([jnp.asarray(v) for v in w])
    for step in range(steps):
        with dist_autograd.context() as ctx:
            h = shards[0].rpc_sync().forward(x)
            y = shards[1].rpc_sync().forward(h)
            loss = rpc.rpc_sync("master", mse, args=(y, target))
            dist_autograd.backward(ctx, [loss])
            optimizer.step(ctx)
        want, grads = jax.value_and_grad(one_process_loss)(plain, x, target)
        updates, state = tx.update(grads, state, plain)
        plain = optax.apply_updates(plain, updates)
        for got, expected in zip(params, plain):
            np.testing.assert_allclose(got.to_here(), expected, rtol=1e-5, atol=1e-6)
        print(f"step {step}: loss {float(loss):.6f} (one process {float(want):.6f})")
    rpc.shutdown()
    print("pipeline over RPC matches one process")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    main(parser.parse_args().steps)
