"""The prefill server's side of a disaggregated request.

A request with a bootstrap room runs one prefill here (max_new_tokens forced to 1) and is then
*held*: finished, its answer not sent, its KV kept. The decode server's handshake (`KVRequest`:
its receive address and how many leading tokens its radix cache already holds) may arrive
before or after that; once both are here the KV of the positions the decode side lacks is sent
with the first token, the KV is released into this server's radix cache and the answer sent.

Bounded: a held request whose decode peer never asks is failed after `timeout` seconds and its
KV freed; a handshake or a cancel whose request never shows up is forgotten after as long.
"""

from __future__ import annotations

import time

import torch

from loom.runtime.disagg import Side
from loom.runtime.disagg.messages import KVCancel, KVHeader, KVRequest
from loom.runtime.req import Req


class PrefillSide(Side):
    def __init__(self, kv, kv_pool, output, transfer, timeout: float, stats: dict):
        super().__init__(kv, kv_pool, output, transfer, timeout, stats)
        self.held: dict[int, tuple[Req, float]] = {}  # room -> (computed request, since)
        self.asked: dict[int, tuple[KVRequest, float]] = {}  # handshakes not yet served
        self.failed: dict[int, tuple[str, float]] = {}  # rooms that failed before a handshake

    @property
    def busy(self) -> bool:
        return bool(self.held)

    def live(self) -> list[Req]:
        """Held requests (they own their prompt's KV)."""
        return [req for req, _ in self.held.values()]

    known = live

    def peer_failed(self, req: Req, message: str) -> None:
        self.fail_room(req.bootstrap_room, message)

    def hold(self, req: Req) -> None:
        """`req` finished its prefill (or failed in it): pair it with its handshake."""
        room = req.bootstrap_room
        if req.finished_reason.get("type") == "abort":
            self._finish(req, None)
            self.fail_room(room, req.finished_reason.get("message", "aborted"))
            return
        if room in self.failed:
            message, _ = self.failed.pop(room)
            self._fail(req, f"the decode server cancelled the transfer: {message}", 502)
            return
        if room in self.asked:
            self._send(req, self.asked.pop(room)[0])
            return
        self.held[room] = (req, time.monotonic())

    def fail_room(self, room: int, message: str) -> None:
        """The request of `room` failed here before it was held: tell its decode side."""
        ask = self.asked.pop(room, None)
        if ask is not None:
            self._send_error(ask[0].decode_addr, room, message)
        else:
            self.failed[room] = (message, time.monotonic())

    def remove(self, rid: str) -> list[Req]:
        """Abort held requests (rid "" = all): KV freed here, the decode side told."""
        gone = []
        for room, (req, _) in list(self.held.items()):
            if rid in ("", req.rid):
                del self.held[room]
                self.kv.release(req)
                self.failed[room] = ("aborted on the prefill server", time.monotonic())
                gone.append(req)
        return gone

    def step(self) -> list:
        """Handshakes and cancels in; KV out; expiry. (Nothing starts running here.)"""
        for msg in self.transfer.recv_control():
            if isinstance(msg, KVCancel):
                entry = self.held.pop(msg.room, None)
                if entry is not None:
                    self._fail(entry[0], f"the decode server cancelled: {msg.reason}", 502)
                else:  # its request may still come: fail it then
                    self.asked.pop(msg.room, None)
                    self.failed[msg.room] = (msg.reason, time.monotonic())
            elif msg.room in self.failed:
                self._send_error(msg.decode_addr, msg.room, self.failed.pop(msg.room)[0])
            elif msg.room in self.held:
                self._send(self.held.pop(msg.room)[0], msg)
            else:
                self.asked[msg.room] = (msg, time.monotonic())
        self._expire()
        return []

    def _expire(self) -> None:
        now = time.monotonic()
        for room, (req, since) in list(self.held.items()):
            if now - since > self.timeout:
                del self.held[room]
                self._fail(
                    req,
                    f"bootstrap_room {room}: no decode server asked for the KV within "
                    f"{self.timeout:g} s (--disaggregation-timeout); KV freed",
                    504,
                )
        for table in (self.asked, self.failed):
            for room in [r for r, (_, since) in table.items() if now - since > self.timeout]:
                del table[room]

    def _send(self, req: Req, ask: KVRequest) -> None:
        n = len(req.origin_input_ids)
        if ask.num_tokens != n or not 0 <= ask.prefix_len <= n:
            message = (
                f"bootstrap_room {ask.room}: the decode server expects a {ask.num_tokens}-token "
                f"prompt (prefix {ask.prefix_len}); this server computed {n} tokens"
            )
            self._send_error(ask.decode_addr, ask.room, message)
            self._fail(req, message, 400)
            return
        start = ask.prefix_len
        m = n - start
        lp = req.logprob
        header = KVHeader(
            room=ask.room,
            start=start,
            num_tokens=m,
            first_token=req.output_ids[0] if req.output_ids else -1,
        )
        if req.return_logprob:
            if lp.output_token_logprobs:
                header.first_logprob = lp.output_token_logprobs[0]
            if lp.top_num and lp.output_top_logprobs:
                header.first_top_logprobs = lp.output_top_logprobs[0]
            header.input_token_logprobs = lp.input_token_logprobs
            header.input_top_logprobs = lp.input_top_logprobs
        k = v = None
        if m > 0:
            row = self.kv.req_to_token_pool.req_to_token[req.req_pool_idx]
            slots = row[start:n]
            k = torch.stack([buf[slots] for buf in self.kv_pool.k_buffers])
            v = torch.stack([buf[slots] for buf in self.kv_pool.v_buffers])
            header.dtype, header.k_shape, header.v_shape = (
                str(k.dtype),
                list(k.shape),
                list(v.shape),
            )
        sent = self.transfer.send_kv(ask.decode_addr, header, k, v)
        self.stats["disagg_transfers"] += 1
        self.stats["disagg_kv_tokens"] += m
        self.stats["disagg_kv_bytes"] += sent
        self._finish(req, None)

    def _send_error(self, addr: str, room: int, message: str) -> None:
        self.transfer.send_kv(addr, KVHeader(room=room, error=message), None, None)

    def _fail(self, req: Req, message: str, status: int) -> None:
        self._finish(req, {"type": "abort", "message": message, "status_code": status})

    def _finish(self, req: Req, reason: dict | None) -> None:
        """Release the KV into the cache (freed on failure) and send the answer."""
        if reason is not None:
            req.finished_reason = reason
        if req.req_pool_idx is not None:  # the prompt's KV is valid either way: cache it
            self.kv.release(req)
        self.output.pending.append(req)
