"""The error a worker sees when a parameter server is gone, and the one read that raises it."""

from __future__ import annotations

from collections.abc import Callable


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


def get_from_servers(refs, unavailable: Callable[[BaseException], str]) -> list:
    """``ray.get(refs)`` of calls on parameter servers, with their failures made plain.

    A dead server's process (``RayActorError``) raises :class:`ServerUnavailableError` with
    the message ``unavailable(error)``; an exception raised inside a server's method is
    re-raised as itself, without Ray's wrapper.
    """
    import ray  # here, not above: this module loads with parallax.ps, which must not load ray

    try:
        return ray.get(refs)
    except ray.exceptions.RayActorError as error:
        raise ServerUnavailableError(unavailable(error)) from None
    except ray.exceptions.RayTaskError as error:
        raise error.cause from None
