"""The error a worker sees when a parameter server is gone."""


class ServerUnavailableError(RuntimeError):
    """A parameter server's process died: its shard of the values is lost.

    Servers are not restarted silently (a fresh one would hold no values); the run goes on
    from a checkpoint of the servers' state (:meth:`parallax.ps.KVStore.save` /
    :meth:`parallax.ps.KVStore.restore`).

    Example:
      >>> str(ServerUnavailableError("server 1 is gone"))
      'server 1 is gone'

    References:
      TensorFlow, ``tf.errors.UnavailableError`` raised by ``ClusterCoordinator`` when a
      parameter server fails.
    """
