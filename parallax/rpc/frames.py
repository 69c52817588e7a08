"""One message on a socket: a pickle and its arrays' raw bytes, sent without a copy.

A message is pickled with protocol 5 (Ray's ``cloudpickle``, so that functions defined in
``__main__`` or in a closure travel by value, as they do through Ray); every contiguous NumPy
array of ``OUT_OF_BAND_BYTES`` or more leaves the pickle as an out-of-band buffer (PEP 574)
and is written to the socket from the array's own memory. The receiver reads each buffer
into one NumPy byte array of its own (the only copy, socket to memory) and the unpickled
array is a view of it: writeable, aligned.

On the socket: a header ``<u32 kind><u32 buffers><u64 pickle bytes>``, the buffers' sizes
(``u64`` each), the pickle, the buffers.

References:
  PEP 574, "Pickle protocol 5 with out-of-band data"; PyTorch's TensorPipe agent sends a
  message's tensors as separate payloads beside the pickle in the same way.
"""

from __future__ import annotations

import pickle
import socket
import struct

import numpy as np
from ray import cloudpickle

HEADER = struct.Struct("<IIQ")
OUT_OF_BAND_BYTES = 4096  # below this an array is copied into the pickle (one write)
IN_ONE_WRITE_BYTES = 1 << 16  # a smaller pickle is joined to its header: one write
CALL, ONE_WAY, ANSWER, FAILURE = 1, 2, 3, 4  # message kinds


class Frame:
    """A message read off a socket, not yet unpickled (unpickling may fail on its own)."""

    __slots__ = ("kind", "data", "buffers")

    def __init__(self, kind: int, data: bytearray, buffers: list):
        self.kind, self.data, self.buffers = kind, data, buffers

    def load(self):
        return cloudpickle.loads(self.data, buffers=self.buffers)


def encode(kind: int, message) -> list:
    """The pieces to write for ``message``: header and pickle, then each array's memory.

    Raises:
      Whatever pickling raises (nothing has been written then).

    Example:
      >>> pieces = encode(CALL, {"x": np.ones(1 << 16, np.float32)})
      >>> len(pieces), pieces[1].nbytes    # the header with the pickle, the array's memory
      (2, 262144)
    """
    buffers: list[memoryview] = []

    def out_of_band(buffer: pickle.PickleBuffer) -> bool:
        view = buffer.raw()
        if view.nbytes < OUT_OF_BAND_BYTES:
            return True  # in the pickle
        buffers.append(view)
        return False

    data = cloudpickle.dumps(message, protocol=5, buffer_callback=out_of_band)
    head = HEADER.pack(kind, len(buffers), len(data)) + struct.pack(
        f"<{len(buffers)}Q", *(view.nbytes for view in buffers))
    if len(data) > IN_ONE_WRITE_BYTES:  # a large pickle is not copied to join its header
        return [head, data, *buffers]
    return [head + data, *buffers]


def send(sock: socket.socket, pieces: list) -> None:
    """Writes ``encode``'s pieces (the arrays straight from their memory)."""
    for piece in pieces:
        sock.sendall(piece)


def _read_into(sock: socket.socket, view: memoryview) -> None:
    while view.nbytes:
        got = sock.recv_into(view)
        if not got:
            raise ConnectionResetError("the other end closed the connection")
        view = view[got:]


def receive(sock: socket.socket) -> Frame:
    """Reads one message (blocking until all of it is here).

    Raises:
      ConnectionError: the other end closed or reset the connection.
    """
    header = bytearray(HEADER.size)
    _read_into(sock, memoryview(header))
    kind, count, size = HEADER.unpack(header)
    sizes = bytearray(8 * count)
    if count:
        _read_into(sock, memoryview(sizes))
    data = bytearray(size)
    _read_into(sock, memoryview(data))
    buffers = []
    for nbytes in struct.unpack(f"<{count}Q", sizes):
        buffer = np.empty(nbytes, np.uint8)  # NumPy's allocator: aligned for any dtype
        _read_into(sock, memoryview(buffer))
        buffers.append(buffer)
    return Frame(kind, data, buffers)
