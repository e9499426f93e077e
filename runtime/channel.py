"""The output path's sockets (scheduler -> detokenizer -> tokenizer manager): one-way message
channels on Unix-domain stream sockets that the receiving thread reads itself.

Why not ZMQ here, as on the request path: a ZMQ hop wakes an I/O thread on each end besides
the receiving thread, so a streamed token cost 7 thread wake-ups across the three processes
(scheduler I/O, detokenizer I/O, main and I/O again, tokenizer manager I/O and loop, the
caller); on these sockets it costs 3 (detokenizer, tokenizer manager's loop, the caller), and
the scheduler's send is one system call on its own thread.

A frame is a 4-byte little-endian length and the message's bytes. The sender listens on the
path of an `ipc://` name and accepts its one receiver on its first send; the receiver
connects, waiting until the sender listens (the processes start in any order). Delivery is in
order; a receiver that falls behind by more than the send buffer holds the sender back; a
sender whose receiver is gone gets BrokenPipeError (the owner sees the dead process).
"""

from __future__ import annotations

import os
import socket
import struct
import time

_LEN = struct.Struct("<I")
_CHUNK = 256 * 1024  # one recv; a larger frame is assembled over several
# The sender's socket buffer: what may wait for a slow receiver before the sender's send
# blocks (the kernel caps it at net.core.wmem_max; the default, ~200 kB, is a few batch-64
# steps with top logprobs, where ZMQ queued 1,000 messages)
_SEND_BUFFER = 4 << 20


def socket_path(name: str) -> str:
    if not name.startswith("ipc://"):
        raise ValueError(f"channel: an ipc:// name is needed, got {name!r}")
    return name[len("ipc://") :]


class Sender:
    def __init__(self, name: str):
        self._path = socket_path(name)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self._path)
        self._listener.listen(1)
        self._sock: socket.socket | None = None

    def send(self, payload: bytes) -> None:
        if self._sock is None:
            self._sock, _ = self._listener.accept()
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SEND_BUFFER)
            self._listener.close()
            os.unlink(self._path)  # connected: the name is no longer needed
        self._sock.sendall(_LEN.pack(len(payload)) + payload)

    def close(self) -> None:
        if self._sock is None:
            self._listener.close()
            os.unlink(self._path)
        else:
            self._sock.close()


class Receiver:
    def __init__(self, name: str, timeout: float | None = None):
        """Connect to the sender of `name`, retrying until it listens (or `timeout` seconds)."""
        path = socket_path(name)
        deadline = None if timeout is None else time.monotonic() + timeout
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        while True:
            try:
                self._sock.connect(path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if deadline is not None and time.monotonic() > deadline:
                    self._sock.close()
                    raise TimeoutError(f"channel: nothing listens on {path}") from None
                time.sleep(0.005)
        self._chunk = bytearray(_CHUNK)
        self._buf = bytearray()
        self.closed = False  # the sender has gone (end of stream)

    def fileno(self) -> int:
        return self._sock.fileno()

    def read(self, block: bool = True, max_bytes: int = 4 * _CHUNK) -> list[bytes]:
        """Every whole message that has arrived; with `block`, waits for at least one (or the
        end of the stream: then [] and `closed`). Stops after about `max_bytes`, leaving the
        rest readable for the next call."""
        out: list[bytes] = []
        flags = 0 if block else socket.MSG_DONTWAIT
        taken = 0
        while not self.closed and taken < max_bytes:
            try:
                n = self._sock.recv_into(self._chunk, _CHUNK, flags)
            except (BlockingIOError, InterruptedError):
                break
            if n == 0:
                self.closed = True
                break
            taken += n
            self._buf += memoryview(self._chunk)[:n]
            out.extend(self._frames())
            if out:  # then only what is already there
                flags = socket.MSG_DONTWAIT
        return out

    def _frames(self) -> list[bytes]:
        buf, pos, out = self._buf, 0, []
        with memoryview(buf) as view:
            while len(buf) - pos >= _LEN.size:
                (n,) = _LEN.unpack_from(buf, pos)
                end = pos + _LEN.size + n
                if end > len(buf):
                    break
                out.append(bytes(view[pos + _LEN.size : end]))
                pos = end
        del buf[:pos]
        return out

    def close(self) -> None:
        self._sock.close()
