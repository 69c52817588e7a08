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


def fail_with_value_error(message):
    raise ValueError(message)


# a graceful shutdown waits for calls between workers


def write_after(path, seconds):
    """Sleeps, then writes ``path``: the side effect a lost call would not have."""
    time.sleep(seconds)
    with open(path, "w") as out:
        out.write("done")
    return path


def call_in_background(to, path, seconds):
    """Starts a call to ``to`` from a thread of this worker and returns at once: a call in
    flight between two workers that the driver never waits for."""
    import threading

    threading.Thread(target=rpc.rpc_sync, args=(to, write_after, (path, seconds)),
                     daemon=True).start()
    return "started"


# the parameter idiom: RRefs to live parameters


class AttributeReadingServer:
    """PyTorch's ``[RRef(p) for p in self.parameters()]`` ported literally: the RRefs hold
    the arrays, the forward reads the attributes (which no gradient or update reaches)."""

    def __init__(self, w):
        self.w = np.asarray(w, np.float32)
        self.params = [rpc.RRef(self.w)]

    def parameter_rrefs(self):
        return self.params

    def forward(self, x):
        return jnp.tanh(x @ self.w)


class RRefReadingServer(AttributeReadingServer):
    """The same model, its forward reading the parameters through their RRefs."""

    def forward(self, x):
        return jnp.tanh(x @ self.params[0].local_value())


def server_forward(server_rref, x):
    return server_rref.rpc_sync().forward(x)


def value_of(rref):
    return rref.to_here()


def pid_of(to):
    return rpc.rpc_sync(to, pid)
