"""Sparse embedding tables on parameter servers: a recommendation model whose workers pull
only the rows a batch touches.

    python examples/ps_embedding.py --steps 40 --users 100000 --items 20000
    python examples/ps_embedding.py --check        # one worker: equal to one device

Ratings come from a hidden low-rank user x item matrix. The model scores a (user, item)
pair with ``dot(u, v) + tower([u, v])``: two embedding tables (``--users`` and ``--items``
rows of ``--dim``), sharded over the parameter servers by ``MaxSizePartitioner``, and a small
dense tower. Each scheduled step pulls only the rows of its batch's users and items
(``px.tf.embedding_lookup``), computes gradients with ``jax.jit`` and pushes them back as
sparse updates; the servers' Adagrad updates just those rows. The script prints how many
bytes a worker pulled per step next to the tables' size: workers never hold the tables.
With ``--check`` (one worker, steps in order) the trained rows are compared with a
one-device run that holds the full tables.
"""

from __future__ import annotations

import argparse
import os
import time

from parallax.cli import simulate_cpu_devices


def rating_batches(pipeline, users, items, batch, count, rank=4):
    """Batches of (user, item, rating) from a hidden rank-``rank`` preference matrix."""
    import numpy as np

    hidden = np.random.default_rng(99)
    user_taste = hidden.standard_normal((users, rank)).astype(np.float32)
    item_traits = hidden.standard_normal((items, rank)).astype(np.float32)
    rng = np.random.default_rng(pipeline)
    for _ in range(count):
        u, i = rng.integers(0, users, batch), rng.integers(0, items, batch)
        score = np.sum(user_taste[u] * item_traits[i], axis=1) / np.sqrt(rank)
        yield {"user": u, "item": i, "rating": (3 + score).astype(np.float32)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ps", type=int, default=2, help="parameter servers")
    parser.add_argument("--users", type=int, default=100_000)
    parser.add_argument("--items", type=int, default=20_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--check", action="store_true",
                        help="one worker, steps in order, compared with one device")
    args = parser.parse_args(argv)
    print(simulate_cpu_devices(8))

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    import parallax as px
    import parallax.ps  # noqa: F401  (Ray loads on first use)
    import parallax.tf  # noqa: F401

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    px.ps.init_cluster(log_to_driver=False)
    workers, dim, tx = (1 if args.check else args.workers), args.dim, optax.adagrad(0.1)
    strategy = px.tf.ParameterServerStrategy(
        px.tf.RayClusterResolver(num_workers=workers, num_ps=args.ps),
        variable_partitioner=px.tf.MaxSizePartitioner(max_shard_bytes=1 << 20))
    strategy.set_optimizer(tx)
    init = lambda shape, dtype: (0.1 * np.random.default_rng(shape[0]).standard_normal(shape)
                                 ).astype(dtype)  # called per shard: no process holds a table
    users = strategy.create_variable(init, shape=(args.users, dim), name="users")
    items = strategy.create_variable(init, shape=(args.items, dim), name="items")
    make_tower = lambda: px.models.MLP(2 * dim, [32], 1, rngs=nnx.Rngs(0))
    tower = strategy.distribute_model(make_tower(), tx)
    coordinator = px.tf.ClusterCoordinator(strategy)
    initial = (users.read(), items.read()) if args.check else None

    def score(tower_model, u, v):
        return jnp.sum(u * v, -1) + tower_model(jnp.concatenate([u, v], -1))[..., 0]

    graphdef = tower.graphdef

    @jax.jit
    def gradients(params, user_rows, user_index, item_rows, item_index, rating):
        def loss(params, user_rows, item_rows):
            predicted = score(nnx.merge(graphdef, params), user_rows[user_index],
                              item_rows[item_index])
            return jnp.mean((predicted - rating) ** 2)
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(params, user_rows, item_rows)

    def train_step(iterator):
        batch = next(iterator)
        client = users.client()  # this process's connection (shared by the tables)
        before = client.bytes_pulled
        u = px.tf.embedding_lookup(users, batch["user"])  # only these rows cross the wire
        v = px.tf.embedding_lookup(items, batch["item"])
        pulled = client.bytes_pulled - before  # measured: what the two lookups received
        loss, (g_tower, g_users, g_items) = gradients(
            tower.pull_params(), u.values, u.inverse, v.values, v.inverse, batch["rating"])
        tower.push_gradients(g_tower)
        users.apply_sparse_gradient(u, g_users)
        items.apply_sparse_gradient(v, g_items)
        return float(loss), pulled

    steps, sizes = args.steps, (args.users, args.items, args.batch)
    dataset = iter(coordinator.create_per_worker_dataset(
        lambda context: rating_batches(context.input_pipeline_id, *sizes, steps)))
    start = time.perf_counter()
    if args.check:
        results = [coordinator.schedule(train_step, args=(dataset,)).fetch() for _ in range(steps)]
    else:
        values = [coordinator.schedule(train_step, args=(dataset,)) for _ in range(steps)]
        coordinator.join()
        results = coordinator.fetch(values)
    seconds = time.perf_counter() - start
    losses = [loss for loss, _ in results]
    pulled = max(b for _, b in results)
    table_bytes = users.nbytes + items.nbytes
    print(f"{steps} steps, {workers} worker(s), {args.ps} servers, {seconds:.1f} s; tables "
          f"{users.num_shards} + {items.num_shards} shards")
    print(f"loss: first 5 steps {np.mean(losses[:5]):.3f}, last 5 steps {np.mean(losses[-5:]):.3f}")
    print(f"embedding rows pulled per step: at most {pulled / 1e3:.1f} kB of the tables' "
          f"{table_bytes / 1e6:.1f} MB ({pulled / table_bytes:.2%})")
    report = {"losses": losses, "pulled_bytes": pulled, "table_bytes": table_bytes}

    if args.check:
        batches = list(rating_batches(0, *sizes, steps))
        graphdef_ref, params = nnx.split(make_tower(), nnx.Param)
        state = (params, jnp.asarray(initial[0]), jnp.asarray(initial[1]))

        @jax.jit
        def reference_step(state, opt_state, batch):
            def loss(state):
                params, u, v = state
                predicted = score(nnx.merge(graphdef_ref, params), u[batch["user"]],
                                  v[batch["item"]])
                return jnp.mean((predicted - batch["rating"]) ** 2)
            value, grads = jax.value_and_grad(loss)(state)
            updates, opt_state = tx.update(grads, opt_state, state)
            return optax.apply_updates(state, updates), opt_state, value

        opt_state, reference = tx.init(state), []
        for batch in batches:
            state, opt_state, value = reference_step(state, opt_state, batch)
            reference.append(float(value))
        gap = px.testing.relative_difference(np.array(losses), np.array(reference))
        rows = px.testing.relative_difference([users.read(), items.read()],
                                              [state[1], state[2]])
        print(f"one worker vs one device: losses {gap:.1e}, embedding rows {rows:.1e} (relative)")
        report.update(loss_gap=gap, row_gap=rows)
    coordinator.shutdown()
    strategy.shutdown()
    return report


if __name__ == "__main__":
    main()
