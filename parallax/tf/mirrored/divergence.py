"""Refusing a mirrored variable that the replicas wrote differently.

A mirrored variable (aggregation ``NONE``: parameters, optimizer state) leaves
``strategy.run`` as one replicated array. If the replica function wrote a different value on
each replica (it applied its own, unaggregated gradients), that array would hold a different
kernel on each device while reading as one value: the model would silently train as N
separate models. TensorFlow 2 keeps such components apart without a word too
(``tensorflow/python/distribute/values.py``, ``_on_write_update_replica``: with aggregation
``NONE`` each replica assigns its own component), and relies on Keras' optimizers to
aggregate first (``apply_gradients(..., experimental_aggregate_gradients=True)`` in
``keras/optimizers/optimizer_v2/optimizer_v2.py``, ``skip_gradients_aggregation=False`` in
the new ``keras/optimizers/optimizer.py``: an all-reduce SUM of the gradients in replica
context). TensorFlow 1 refused the write (``values_util.aggregation_error_msg``: "You must
specify an aggregation method to update a MirroredVariable in Replica Context").

parallax has no optimizer of its own to aggregate in (the replica function calls optax or
``nnx.Optimizer``), so it refuses, as TensorFlow 1 did, but only when the values really
differ: inside the program each mirrored leaf is hashed exactly and the hashes compared
across the replicas (:func:`parallax.comm.replication.differs`: one extra read of the
mirrored state and a few bytes of traffic); ``run`` reads the flags (a host sync, as reading
the loss is) and raises before the state is written back. Under the caller's own
``jax.jit`` there is nothing to read and no check (the flags are dropped from the program):
call ``run`` outside ``jit`` to check.
"""

from __future__ import annotations

import jax


def raise_if_diverged(api: str, nodes, mirrored_index: list[int], flags) -> None:
    """Raises ``ValueError`` naming every mirrored variable the replicas wrote differently.

    Args:
      api: the API name for the message.
      nodes: the NNX objects passed to ``run`` (the tuple split into the state).
      mirrored_index: the state leaves the flags are for (their positions in the state).
      flags: what :func:`differs` returned.
    """
    if isinstance(flags, jax.core.Tracer):
        # run inside the user's own jax.jit (TF's tf.function around the step): no value to
        # read, so no check; the unused flags and their all-reduce are dropped from the
        # program. Call run outside jit to check.
        return
    flags = jax.device_get(flags)
    if not flags.any():
        return
    from flax import nnx  # the state's paths, only on the error path

    paths = [jax.tree_util.keystr(p) for p, _ in
             jax.tree_util.tree_flatten_with_path(nnx.split(tuple(nodes))[1])[0]]
    names = []
    for i, bad in zip(mirrored_index, flags):
        if bad:
            head, _, rest = paths[i].partition("]")
            k = int(head.lstrip("["))
            names.append(f"{type(nodes[k]).__name__} (NNX object {k} in args){rest}")
    raise ValueError(
        f"{api}: the replica function wrote a different value on each replica into the "
        f"mirrored variable(s) {', '.join(names)}; a mirrored variable must be the same on "
        "every replica (the replicas would otherwise train as separate models). Aggregate "
        "the gradients before applying them, as Keras' optimizers do under "
        "MirroredStrategy: grads = px.tf.get_replica_context().all_reduce('SUM', grads) "
        "(with a loss from px.tf.compute_average_loss). A variable meant to differ per "
        "replica needs an aggregation: nnx.Variable(..., aggregation='mean' | 'sum' | "
        "'only_first_replica').")
