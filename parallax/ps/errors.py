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


class HandleError(RuntimeError):
    """A server's handle raised while serving a request; the message names the server.

    Raised by :meth:`parallax.ps.KVWorker.wait` once every server of the request has
    answered (the other servers' parts are applied); the handle's exception is the
    ``__cause__`` and its server-side traceback is in the message.

    Example:
      >>> str(HandleError("server 1 failed"))
      'server 1 failed'

    References:
      PS-Lite's ``KVServer::Process`` runs the request handle for every request
      (``include/ps/kv_app.h``); there an exception would end the server process.
    """


def raise_handle_failures(api: str, failures: list, num_servers: int) -> None:
    """Raises :class:`HandleError` for the first of ``failures`` (``HandleFailure``s)."""
    if not failures:
        return
    first = failures[0]
    others = "" if len(failures) == 1 else (
        f" (servers {[f.server for f in failures[1:]]} failed too)")
    raise HandleError(
        f"{api}: the handle of server {first.server} of {num_servers} (keys [{first.begin}, "
        f"{first.end})) raised {type(first.error).__name__}: {first.error} while serving "
        f"{first.api}{others}; the other servers' parts of the request were applied. "
        f"Server traceback:\n{first.trace}") from first.error
