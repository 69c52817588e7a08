"""PyTorch's "Implementing a Parameter Server Using Distributed RPC Framework" on
parallax.rpc: a ParameterServer worker owns the model; two trainer workers hold an RRef to
it, run the forward through RPC on the server, the backward with distributed autograd and
step a DistributedOptimizer over the server's parameter RRefs.

The model is a tiny MLP classifier on tiny synthetic data (the tutorial's is a CNN on MNIST).
As in the tutorial, each trainer has its own DistributedOptimizer (SGD, so there is no
optimizer state to tell apart) and its own batches; the server's parameters are shared.

Checked configuration: the trainers take turns (the driver runs one step of trainer 1, then
one of trainer 2, and so on), so every step reads the parameters left by the step before it
and the run equals, to 1e-5, one process applying the same steps in the same order. With
``--concurrent`` the trainers step at the same time, as in the tutorial: a trainer's forward
may then read parameters that the other trainer updates before its own step lands, so the
result depends on timing (Hogwild-like) and is not compared with one process.

    python examples/rpc/parameter_server.py --steps 3

References:
  PyTorch tutorials, ``rpc_param_server_tutorial`` (ParameterServer, TrainerNet,
  ``get_global_param_rrefs``, ``dist_autograd.backward``, ``DistributedOptimizer``).
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax

import parallax.rpc as rpc
from parallax.rpc import dist_autograd

TRAINERS = ["trainer1", "trainer2"]
LEARNING_RATE = 0.1


def mlp(params, x):
    """The model: a two-layer perceptron giving log-probabilities of 3 classes."""
    w1, b1, w2, b2 = params
    return jax.nn.log_softmax(jnp.tanh(x @ w1 + b1) @ w2 + b2)


def nll_loss(log_probs, labels):
    """Mean negative log-likelihood (``F.nll_loss``)."""
    return -jnp.mean(jnp.take_along_axis(log_probs, labels[:, None], axis=1))


class ParameterServer:
    """Owns the model's parameters (one RRef each) and runs its forward for the trainers."""

    def __init__(self, params):
        self.params = [rpc.RRef(np.asarray(p)) for p in params]

    def parameter_rrefs(self):
        return self.params

    def forward(self, x):
        return mlp([p.local_value() for p in self.params], x)


class Trainer:
    """A trainer worker: an RRef to the server, its own DistributedOptimizer over the server's
    parameters, and a training step under a distributed autograd context."""

    def __init__(self, server):
        self.server = server
        self.name = rpc.get_worker_info().name
        params = server.rpc_sync().parameter_rrefs()
        self.optimizer = rpc.DistributedOptimizer(optax.sgd(LEARNING_RATE), params)

    def train_step(self, x, labels):
        with dist_autograd.context() as ctx:
            log_probs = self.server.rpc_sync().forward(x)  # runs on the server, recorded
            loss = rpc.rpc_sync(self.name, nll_loss, args=(log_probs, labels))  # local, recorded
            dist_autograd.backward(ctx, [loss])
            self.optimizer.step(ctx)
        return float(loss)


def make_data(steps: int):
    """Initial parameters and, per trainer and step, a batch of 16 points in 8 dimensions
    labelled by a fixed random linear map (3 classes)."""
    rng = np.random.default_rng(0)
    shapes = [(8, 16), (16,), (16, 3), (3,)]
    params = [(rng.normal(size=s) / 3).astype(np.float32) for s in shapes]
    teacher = rng.normal(size=(8, 3))
    batches = {}
    for name in TRAINERS:
        xs = rng.normal(size=(steps, 16, 8)).astype(np.float32)
        batches[name] = [(x, np.argmax(x @ teacher, axis=1).astype(np.int32)) for x in xs]
    return params, batches


def one_process(params, batches, steps: int):
    """The same steps in the same order (trainers taking turns) in this process."""
    tx = optax.sgd(LEARNING_RATE)
    params = [jnp.asarray(p) for p in params]
    losses = []
    for step in range(steps):
        for name in TRAINERS:
            state = tx.init(params)  # SGD: stateless, as each trainer's own optimizer is
            loss, grads = jax.value_and_grad(lambda p: nll_loss(mlp(p, batches[name][step][0]),
                                                                batches[name][step][1]))(params)
            updates, _ = tx.update(grads, state, params)
            params = optax.apply_updates(params, updates)
            losses.append(float(loss))
    return params, losses


def main(steps: int = 3, concurrent: bool = False) -> None:
    params, batches = make_data(steps)
    rpc.init_rpc("driver", rank=0, world_size=4,
                 worker_names=["driver", "parameter_server", *TRAINERS])
    server = rpc.remote("parameter_server", ParameterServer, args=(params,))
    trainers = {name: rpc.remote(name, Trainer, args=(server,)) for name in TRAINERS}
    losses = []
    for step in range(steps):
        if concurrent:
            futures = [trainers[n].rpc_async().train_step(*batches[n][step]) for n in TRAINERS]
            losses += rpc.wait_all(futures)
        else:  # lock-step: one trainer at a time, in a fixed order
            losses += [trainers[n].rpc_sync().train_step(*batches[n][step]) for n in TRAINERS]
        print(f"step {step}: " + ", ".join(f"{n} loss {v:.6f}"
                                           for n, v in zip(TRAINERS, losses[-2:])))
    final = [p.to_here() for p in server.rpc_sync().parameter_rrefs()]
    rpc.shutdown()
    if concurrent:
        print("trainers ran concurrently: not compared with one process (timing-dependent)")
        return
    want_params, want_losses = one_process(params, batches, steps)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for got, want in zip(final, want_params):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    print("parameter server over RPC matches one process")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--concurrent", action="store_true",
                        help="trainers step at the same time (not compared with one process)")
    args = parser.parse_args()
    main(args.steps, args.concurrent)
