"""Functions the RPC tests run on workers (shipped by value: Ray workers lack tests/)."""

import os
import time

import jax.numpy as jnp
import numpy as np

import parallax.rpc as rpc


def pid():
    return os.getpid()


def add(a, b=0):
    return a + b


def tree_add(a, b):
    import jax

    return jax.tree.map(lambda x, y: x + y, a, b)


def sleep_then(seconds, value):
    time.sleep(seconds)
    return value


def fail(message):
    raise KeyError(message)


def num_owned():
    from parallax.rpc.agent import current_agent

    return current_agent("test").state.num_owned()


def hold(rref):
    """Keeps ``rref`` alive on this worker (in a value of its own) and returns that RRef."""
    return rpc.RRef([rref])


def ones(n):
    return np.ones(n, np.float32)


@rpc.functions.async_execution
def add_on(to, a, b):
    return rpc.rpc_async(to, add, args=(a, b)).then(lambda f: f.wait() * 10)


class Counter:
    def __init__(self, start):
        self.count = start

    def bump(self, by):
        self.count += by
        return self.count


# distributed autograd: a two-layer model, parameters in RRefs on their workers


def layer(w_rref, x):
    return jnp.tanh(x @ w_rref.local_value())


def layer_from(w_rref, x):  # reads a parameter that may live elsewhere
    return jnp.tanh(x @ w_rref.to_here())


def squared_error(y, target):
    return jnp.mean((y - target) ** 2)


def scale_by(w_rref, x):
    return x * w_rref.to_here()


def forward_along(next_worker, w_rref, x):
    """On one worker: a layer of its own, then the rest of the chain on ``next_worker``."""
    return rpc.rpc_sync(next_worker, scale_by, args=(w_rref, jnp.sin(x)))


def open_record_calls():  # on a worker: record_calls belongs to the driver
    from parallax.rpc.call_log import record_calls

    with record_calls():
        pass
