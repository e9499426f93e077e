"""The KV transfer layer: an interface, and its first backend, ZMQ over TCP.

A backend moves two kinds of traffic: control messages from a decode server to a prefill
server's bootstrap address (`KVRequest`, `KVCancel`), and KV from the prefill server to the
decode server's receive address (a `KVHeader` and, unless it carries an error, a K and a V
tensor). Everything is non-blocking: the scheduler polls once per step. A cluster backend
(RDMA writes straight into the decode pool, as Mooncake or NIXL do) implements the same five
methods.
"""

from __future__ import annotations

import logging
import socket
import warnings
from abc import ABC, abstractmethod

import msgspec
import torch

from loom.runtime.disagg.messages import KVHeader, ToPrefill
from loom.runtime.io_struct import decoder, encode

logger = logging.getLogger(__name__)


class KVTransfer(ABC):
    """`address`: where peers reach this side (prefill: its bootstrap address; decode: where
    KV is sent)."""

    address: str

    # prefill side
    @abstractmethod
    def recv_control(self) -> list[ToPrefill]: ...

    @abstractmethod
    def send_kv(
        self, addr: str, header: KVHeader, k: torch.Tensor | None, v: torch.Tensor | None
    ) -> int:
        """Queue the header (and K, V when given) for `addr`; returns the KV bytes sent."""

    # decode side
    @abstractmethod
    def send_control(self, addr: str, msg: ToPrefill) -> None: ...

    @abstractmethod
    def recv_kv(self) -> list[tuple[KVHeader, torch.Tensor | None, torch.Tensor | None]]: ...

    @abstractmethod
    def close(self) -> None: ...


_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn)}


def advertised_host(host: str) -> str:
    """The address peers use for a server bound to `host` (a wildcard names this machine)."""
    if host in ("0.0.0.0", "::", ""):
        return socket.gethostbyname(socket.gethostname())
    return host


class ZmqTransfer(KVTransfer):
    """PULL sockets bound at this side's address, one PUSH socket per peer (lingering 0, so
    a dead peer never blocks shutdown). KV frames go out with copy=False: zmq sends the
    gathered tensors' own buffers."""

    def __init__(self, mode: str, host: str, bootstrap_port: int):
        import zmq

        self._zmq = zmq
        # the process-wide context: terminating a private one blocks on any socket not yet
        # closed (a scheduler dropped without close() would hang the garbage collector)
        self.ctx = zmq.Context.instance()
        self.recv = self.ctx.socket(zmq.PULL)
        self.recv.setsockopt(zmq.LINGER, 0)
        bind_host = "*" if host in ("0.0.0.0", "::", "") else host
        if mode == "prefill":
            self.recv.bind(f"tcp://{bind_host}:{bootstrap_port}")
            port = bootstrap_port
        else:
            port = self.recv.bind_to_random_port(f"tcp://{bind_host}")
        self.address = f"tcp://{advertised_host(host)}:{port}"
        self.peers: dict[str, object] = {}
        self._control = decoder(ToPrefill)
        self._header = decoder(KVHeader)

    def _peer(self, addr: str):
        sock = self.peers.get(addr)
        if sock is None:
            sock = self.ctx.socket(self._zmq.PUSH)
            sock.setsockopt(self._zmq.LINGER, 0)
            sock.connect(addr)
            self.peers[addr] = sock
        return sock

    def _drain(self) -> list[list]:
        out = []
        while True:
            try:
                out.append(self.recv.recv_multipart(self._zmq.NOBLOCK, copy=False))
            except self._zmq.Again:
                return out

    def recv_control(self) -> list[ToPrefill]:
        out = []
        for frames in self._drain():
            try:
                out.append(self._control.decode(frames[0].buffer))
            except msgspec.DecodeError as e:  # a stranger on the port: never the scheduler's end
                logger.warning("disaggregation: dropped a malformed control message: %s", e)
        return out

    def send_control(self, addr: str, msg: ToPrefill) -> None:
        self._peer(addr).send(encode(msg), self._zmq.NOBLOCK)

    def send_kv(self, addr, header, k, v) -> int:
        frames = [encode(header)]
        if k is not None:
            frames += [_as_bytes(k), _as_bytes(v)]
        self._peer(addr).send_multipart(frames, self._zmq.NOBLOCK, copy=False)
        return sum(f.nbytes for f in frames[1:])

    def recv_kv(self):
        out = []
        for frames in self._drain():
            try:
                header = self._header.decode(frames[0].buffer)
            except msgspec.DecodeError as e:
                logger.warning("disaggregation: dropped a malformed KV message: %s", e)
                continue
            if header.error is not None or len(frames) < 3:
                out.append((header, None, None))
                continue
            try:
                dtype = _DTYPES[header.dtype]
                k = _from_bytes(frames[1].buffer, dtype, header.k_shape)
                v = _from_bytes(frames[2].buffer, dtype, header.v_shape)
            except (KeyError, RuntimeError, ValueError) as e:  # the request fails, not the server
                header.error = f"unreadable KV frames ({type(e).__name__}: {e})"
                k = v = None
            out.append((header, k, v))
        return out

    def close(self) -> None:
        for sock in self.peers.values():
            sock.close(linger=0)
        self.recv.close(linger=0)


def _as_bytes(t: torch.Tensor):
    """A contiguous CPU tensor's buffer as a uint8 numpy array (numpy has no bfloat16)."""
    t = t.detach().contiguous().cpu()
    return t.view(-1).view(torch.uint8).numpy()


def _from_bytes(buf, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    with warnings.catch_warnings():  # a read-only zmq frame: the tensor is only read
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(buf, dtype=torch.uint8)
    return flat.view(dtype).view(shape)


def create_transfer(args) -> KVTransfer:
    """The backend named by --disaggregation-transfer-backend (only zmq is built)."""
    if args.disaggregation_transfer_backend == "zmq":
        return ZmqTransfer(args.disaggregation_mode, args.host, args.disaggregation_bootstrap_port)
    raise ValueError(
        f"disaggregation_transfer_backend: {args.disaggregation_transfer_backend!r} is not built"
    )
