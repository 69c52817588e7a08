"""Models, data and worker functions for the parameter-server strategy tests.

Ray's workers cannot import the test packages, so this module is pickled by value
(``ray.cloudpickle.register_pickle_by_value``): what the functions use travels with them.
"""

import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import parallax as px

TX = optax.adagrad(0.1)  # element-wise: sparse pushes equal dense updates of the touched rows
USERS, ITEMS, DIM = 1000, 500, 8


def mlp():
    return px.models.MLP(4, [16], 2, rngs=nnx.Rngs(0))


def mlp_batches(steps, batch=8, seed=0):
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((batch, 4)).astype(np.float32),
             "y": rng.standard_normal((batch, 2)).astype(np.float32)} for _ in range(steps)]


def reference_run(model, tx, loss_fn, batches):
    """One device: jit(value_and_grad) and tx on the full parameters."""
    graphdef, params = nnx.split(model, nnx.Param)

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p), batch))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state, losses = tx.init(params), []
    for batch in batches:
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    return losses, params, opt_state


# -- the recommendation model: embedding tables on the servers, a dense tower --------------

def rating_batches(steps, batch=32, seed=0):
    rng = np.random.default_rng(seed)
    return [{"user": rng.integers(0, USERS, batch), "item": rng.integers(0, ITEMS, batch),
             "rating": rng.uniform(1, 5, batch).astype(np.float32)} for _ in range(steps)]


def tower():
    return px.models.MLP(2 * DIM, [16], 1, rngs=nnx.Rngs(1))


def rating_loss(tower_model, user_vectors, item_vectors, rating):
    features = jnp.concatenate([user_vectors, item_vectors], axis=-1)
    score = jnp.sum(user_vectors * item_vectors, -1) + tower_model(features)[..., 0]
    return jnp.mean((score - rating) ** 2)


def make_sparse_step(server_tower, users, items):
    """A worker step: pull the touched rows and the tower, jitted gradients, sparse pushes."""
    graphdef = server_tower.graphdef

    @jax.jit
    def grads(params, user_rows, user_inverse, item_rows, item_inverse, rating):
        def loss(params, user_rows, item_rows):
            return rating_loss(nnx.merge(graphdef, params), user_rows[user_inverse],
                               item_rows[item_inverse], rating)
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(params, user_rows, item_rows)

    def step(iterator):
        batch = next(iterator)
        client = users.client()  # this process's connection (shared by the tables)
        before = client.bytes_pulled
        user_rows = px.tf.embedding_lookup(users, batch["user"])
        item_rows = px.tf.embedding_lookup(items, batch["item"])
        pulled = client.bytes_pulled - before  # measured: what the two lookups received
        loss, (g_tower, g_users, g_items) = grads(
            server_tower.pull_params(), user_rows.values, user_rows.inverse, item_rows.values,
            item_rows.inverse, batch["rating"])
        server_tower.push_gradients(g_tower)
        users.apply_sparse_gradient(user_rows, g_users)
        items.apply_sparse_gradient(item_rows, g_items)
        return {"loss": loss, "table_bytes_pulled": pulled}

    return step


def reference_rating_run(tower_model, user_table, item_table, tx, batches):
    graphdef, params = nnx.split(tower_model, nnx.Param)
    state = (params, jnp.asarray(user_table), jnp.asarray(item_table))

    @jax.jit
    def step(state, opt_state, batch):
        def loss(state):
            params, users, items = state
            return rating_loss(nnx.merge(graphdef, params), users[batch["user"]],
                               items[batch["item"]], batch["rating"])
        value, grads = jax.value_and_grad(loss)(state)
        updates, opt_state = tx.update(grads, opt_state, state)
        return optax.apply_updates(state, updates), opt_state, value

    opt_state, losses = tx.init(state), []
    for batch in batches:
        state, opt_state, value = step(state, opt_state, batch)
        losses.append(float(value))
    return losses, state


# -- coordinator functions ----------------------------------------------------------------

def counted_step(counter, delay, iterator):
    """Adds 1 to ``counter`` on the servers (sgd(0.5) of -2); returns (pid, next element)."""
    element = next(iterator)
    time.sleep(delay)
    counter.apply_gradient(np.full(1, -2.0, np.float32))
    return os.getpid(), element


def failing(message):
    raise ValueError(message)


# -- what a scheduled function asks of the strategy (test_parameter_server_api.py) ---------

def replica_facts(strategy):
    """TensorFlow's answers inside a scheduled function: the contexts, run, reduce, devices."""
    outside = px.tf.get_replica_context()  # the scheduled function: cross-replica context
    facts = {"outside_run": outside, "scope": type(px.tf.get_strategy()).__name__,
             "replicas": strategy.num_replicas_in_sync,
             "worker_devices": strategy.extended.worker_devices,
             "parameter_devices": strategy.extended.parameter_devices}

    def replica_fn(x):
        context = px.tf.get_replica_context()
        try:
            strategy.reduce("SUM", x, axis=None)
            refused = ""
        except ValueError as error:
            refused = str(error)
        return {"id": int(context.replica_id_in_sync_group),
                "replicas": context.num_replicas_in_sync,
                "all_reduce": context.all_reduce("SUM", x), "reduce_refused": refused,
                "merged": context.merge_call(lambda s, v: s.reduce("MEAN", v, axis=0),
                                             args=(jnp.asarray(x),))}

    per_replica = strategy.run(replica_fn, args=(np.arange(4.0, dtype=np.float32),))
    facts.update(run=per_replica,
                 sum_none=strategy.reduce(px.tf.ReduceOp.SUM, np.float32(2.5), axis=None),
                 mean_none=strategy.reduce("MEAN", np.arange(3.0), axis=None),
                 sum_axis=strategy.reduce("SUM", np.arange(6.0).reshape(2, 3), axis=0),
                 mean_axis=strategy.reduce("MEAN", np.arange(6.0).reshape(2, 3), axis=1),
                 local=strategy.experimental_local_results(np.float32(1)))
    return facts


def read_and_update(variable, shard_delta):
    """On a worker: read as TensorFlow reads a variable, assign_sub one shard."""
    before = np.asarray(variable)
    variable.variables[-1].assign_sub(shard_delta)
    return before, variable.numpy(), (variable * 2).tolist()


def next_element(iterator):
    return next(iterator)
