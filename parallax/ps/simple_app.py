"""PS-Lite's ``SimpleApp``: integer-headed string requests to the servers, and their replies.

``SimpleApp::Request(req_head, req_body, recv_id)`` sends an ``int`` head and a ``string``
body to one server or to every server; each runs the app's request handle, which answers
with ``app->Response(req, res_body)``; ``Wait(ts)`` returns once every reply is in. Here the
app runs on a :class:`parallax.ps.KVStore`'s server actors (its server nodes), beside the
key-value requests: ``store.simple_app()``.

Not re-created: PS-Lite's response handle (``set_response_handle``): :meth:`SimpleApp.wait`
returns the replies instead; and requests from servers to workers (here only workers and
the driver send requests).
"""

from __future__ import annotations

import dataclasses

from parallax.ps.errors import get_from_servers, raise_handle_failures
from parallax.ps.request import HandleFailure

SERVER_GROUP = -1  # recv_id: every server (PS-Lite's kServerGroup)


@dataclasses.dataclass(frozen=True)
class SimpleData:
    """A request or a reply (PS-Lite's ``SimpleData``): ``head``, ``body`` and who sent it.

    ``sender`` is the app's rank (-1 for none) in a request and the server's rank in a
    reply; ``timestamp`` is the request's.

    References:
      PS-Lite, ``struct SimpleData`` (``include/ps/simple_app.h``).
    """

    head: int
    body: str
    sender: int
    timestamp: int
    customer_id: int = 0


def default_request_handle(request: SimpleData, app) -> None:
    """PS-Lite's default: reply with an empty body."""
    app.response(request)


class SimpleApp:
    """Sends ``(head, body)`` requests to a store's servers (PS-Lite's ``SimpleApp``).

    Example:
      >>> import parallax as px
      >>> _ = px.ps.init_cluster()
      >>> with px.ps.KVStore(num_servers=2) as store:
      ...     app = store.simple_app()
      ...     app.set_request_handle(lambda req, server: server.response(req, req.body * 2))
      ...     [r.body for r in app.wait(app.request(1, "ab"))]
      ['abab', 'abab']

    References:
      PS-Lite, ``SimpleApp`` (``include/ps/simple_app.h``, ``tests/test_simple_app.cc``).
    """

    def __init__(self, servers: list, ranges, app_id: int, rank: int = -1):
        self._servers, self._ranges = list(servers), tuple(ranges)
        self.app_id, self.rank = app_id, rank
        self._next_timestamp = 0
        self._pending: dict[int, tuple[list[int], list]] = {}

    def set_request_handle(self, handle) -> None:
        """Sets what every server does with a request: ``handle(request, server)``.

        The handle answers with ``server.response(request, body="")``; a handle that
        returns without answering replies with an empty body (PS-Lite would never reply).
        """
        if not callable(handle):
            raise TypeError(f"SimpleApp.set_request_handle: the handle must be callable as "
                            f"handle(request, server), got {type(handle).__name__}.")
        self._get([s.set_simple_handle.remote(self.app_id, handle) for s in self._servers],
                  list(range(len(self._servers))))

    def request(self, head: int, body: str = "", recv_id: int = SERVER_GROUP) -> int:
        """Sends ``(head, body)`` to server ``recv_id`` (or every server); returns a timestamp."""
        if isinstance(head, bool) or not isinstance(head, int):
            raise TypeError(f"SimpleApp.request: head must be an int, got {type(head).__name__}.")
        if not isinstance(body, str):
            raise TypeError(f"SimpleApp.request: body must be a str, got {type(body).__name__}.")
        if recv_id != SERVER_GROUP and not 0 <= recv_id < len(self._servers):
            raise ValueError(f"SimpleApp.request: recv_id {recv_id} is not a server (0 .. "
                             f"{len(self._servers) - 1}) nor px.ps.SERVER_GROUP (every server).")
        servers = list(range(len(self._servers))) if recv_id == SERVER_GROUP else [recv_id]
        timestamp = self._next_timestamp
        self._next_timestamp += 1
        request = SimpleData(int(head), body, self.rank, timestamp)
        self._pending[timestamp] = (servers, [self._servers[s].simple.remote(self.app_id, request)
                                              for s in servers])
        return timestamp

    def wait(self, timestamp: int) -> list[SimpleData]:
        """The replies to request ``timestamp``, in server order (PS-Lite's ``Wait``).

        Raises:
          HandleError: a server's request handle raised.
        """
        if timestamp not in self._pending:
            raise ValueError(f"SimpleApp.wait: timestamp {timestamp!r} is not a request in "
                             f"flight (issued 0..{self._next_timestamp - 1}, each waited once).")
        servers, refs = self._pending.pop(timestamp)
        replies = self._get(refs, servers)
        raise_handle_failures("SimpleApp.wait",
                              [r for r in replies if isinstance(r, HandleFailure)],
                              len(self._servers))
        return replies

    def _get(self, refs, servers):
        return get_from_servers(refs, lambda error: (
            f"SimpleApp: a server of {servers} died ({type(error).__name__}); restart the "
            f"store and restore it from a checkpoint."))

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_pending"] = {}
        return state
