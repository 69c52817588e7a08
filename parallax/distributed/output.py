"""The launched processes' output: every line prefixed with its rank, the last lines kept.

Example:
  >>> import io
  >>> sink = io.BytesIO()
  >>> stream = RankOutput(rank=1, sink=sink)
  >>> stream.feed(b"loss 0.5\\nloss 0.4\\nepo")
  >>> stream.feed(b"ch 2\\n")
  >>> sink.getvalue().decode()
  '[1] loss 0.5\\n[1] loss 0.4\\n[1] epoch 2\\n'
  >>> stream.tail(2)
  ['loss 0.4', 'epoch 2']
"""

from __future__ import annotations

import collections
import re
from typing import BinaryIO

KEEP_LINES = 60
_ENDS = re.compile(rb"[^\r\n]*(?:\r\n|\r|\n)")


class RankOutput:
    """One stream (stdout or stderr) of one rank: prefixes lines, remembers the last ones.

    A line ends at ``\\n`` or ``\\r`` (progress bars redraw with ``\\r``); a partial line waits
    for its end, or for :meth:`close`. ``tails`` may be shared by a rank's two streams.
    """

    def __init__(self, rank: int, sink: BinaryIO, *, prefix: bool = True,
                 tails: collections.deque | None = None):
        self.sink = sink
        self.prefix = f"[{rank}] ".encode() if prefix else b""
        self.tails = collections.deque(maxlen=KEEP_LINES) if tails is None else tails
        self._pending = b""

    def feed(self, data: bytes) -> None:
        """Writes the complete lines of ``pending + data``; keeps the rest for later."""
        data = self._pending + data
        end = 0
        out = []
        for match in _ENDS.finditer(data):
            line = match.group(0)
            out.append(self.prefix + line)
            self._remember(line)
            end = match.end()
        self._pending = data[end:]
        if out:
            self.sink.write(b"".join(out))
            self.sink.flush()

    def close(self) -> None:
        """Writes a last partial line, if any."""
        if self._pending:
            self.sink.write(self.prefix + self._pending + b"\n")
            self.sink.flush()
            self._remember(self._pending)
            self._pending = b""

    def _remember(self, line: bytes) -> None:
        text = line.decode("utf-8", "replace").rstrip("\r\n")
        if text.strip():
            self.tails.append(text)

    def tail(self, count: int = 10) -> list[str]:
        """The last ``count`` non-empty lines seen."""
        return list(self.tails)[-count:]
