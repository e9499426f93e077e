"""The decode server's side of a disaggregated request.

A request with bootstrap fields skips prefill here. `step` admits queued requests front to
back: a request row, the radix-cache match of its prompt (locked), KV slots for the rest of
the prompt; then the handshake (`KVRequest`) goes to the prefill server named by the request.
While the KV is on its way the request is `waiting` (it owns the slots: kv_len is the prompt
length, the KV not yet written). When the KV and the first token arrive they are written into
the pool and the request joins the running batch as if it had been prefilled here.

Bounded: a request whose KV has not arrived `timeout` seconds after it came in is failed, its
slots freed and the prefill side told (`KVCancel`); so is an aborted one.
"""

from __future__ import annotations

import time

from loom.runtime.disagg import Side
from loom.runtime.disagg.messages import KVCancel, KVHeader, KVRequest
from loom.runtime.req import Req


class DecodeSide(Side):
    def __init__(self, kv, kv_pool, output, transfer, timeout: float, stats: dict):
        super().__init__(kv, kv_pool, output, transfer, timeout, stats)
        self.queue: list[tuple[Req, float]] = []  # no KV yet (request row or pool short)
        self.waiting: dict[int, tuple[Req, float]] = {}  # room -> (request, arrival)

    def __len__(self) -> int:
        return len(self.queue) + len(self.waiting)

    @property
    def busy(self) -> bool:
        return bool(self.queue or self.waiting)

    def live(self) -> list[Req]:
        """Requests here that hold KV."""
        return [req for req, _ in self.waiting.values()]

    def known(self) -> list[Req]:
        return [req for req, _ in self.queue] + self.live()

    def add(self, req: Req) -> None:
        self.queue.append((req, time.monotonic()))

    def remove(self, rid: str) -> list[Req]:
        """Abort (rid "" = all): KV freed here, the prefill side told."""
        gone = [req for req, _ in self.queue if rid in ("", req.rid)]
        self.queue = [(r, t) for r, t in self.queue if rid not in ("", r.rid)]
        for room, (req, _) in list(self.waiting.items()):
            if rid in ("", req.rid):
                del self.waiting[room]
                self._cancel(req, "aborted on the decode server")
                gone.append(req)
        return gone

    def peer_failed(self, req: Req, reason: str) -> None:
        """`req` failed here before its handshake (e.g. validation): free the prefill side."""
        self.transfer.send_control(_bootstrap_addr(req), KVCancel(req.bootstrap_room, reason))

    def step(self) -> list[tuple[Req, KVHeader]]:
        """Admit, receive, expire; returns the requests whose KV arrived (to run), each with
        its header (the first token)."""
        self._admit()
        ready = []
        for header, k, v in self.transfer.recv_kv():
            entry = self.waiting.pop(header.room, None)
            if entry is None:
                continue  # cancelled or timed out here already
            req = entry[0]
            if header.error is not None:
                self._release(req)
                self.output.finish_with_error(
                    req, f"prefill server: {header.error}", status_code=502
                )
            elif self._write(req, header, k, v):
                ready.append((req, header))
        now = time.monotonic()
        for room, (req, since) in list(self.waiting.items()):
            if now - since > self.timeout:
                del self.waiting[room]
                self._fail_timeout(req, room)
        return ready

    def _fail_timeout(self, req: Req, room: int) -> None:
        message = (
            f"bootstrap_room {room}: the KV did not arrive from {_bootstrap_addr(req)} within "
            f"{self.timeout:g} s (--disaggregation-timeout); KV freed"
        )
        self._cancel(req, message)
        self.output.finish_with_error(req, message, status_code=504)

    def _admit(self) -> None:
        now = time.monotonic()
        while self.queue:
            req, since = self.queue[0]
            if now - since > self.timeout:
                self.queue.pop(0)
                self._fail_timeout(req, req.bootstrap_room)
                continue
            n = len(req.origin_input_ids)
            if not self.kv.admit(req, n):
                return  # no request row free: wait for one
            prefix = req.kv_len
            if self.kv.alloc(req, n - prefix) is None:
                self.kv.undo_admit(req)
                return  # KV short: decoding requests free it as they finish
            self.queue.pop(0)
            req.kv_len = n  # the slots are owned from now on, written when the KV arrives
            req.cached_tokens = prefix
            self.waiting[req.bootstrap_room] = (req, since)
            ask = KVRequest(req.bootstrap_room, req.rid, self.transfer.address, prefix, n)
            self.transfer.send_control(_bootstrap_addr(req), ask)

    def _write(self, req: Req, header: KVHeader, k, v) -> bool:
        n = len(req.origin_input_ids)
        prefix = len(req.prefix_indices)
        pool = self.kv_pool
        want_k = [len(pool.k_buffers), header.num_tokens, *pool.k_buffers[0].shape[1:]]
        want_v = [len(pool.v_buffers), header.num_tokens, *pool.v_buffers[0].shape[1:]]
        problem = None
        if header.start != prefix or header.start + header.num_tokens != n:
            problem = (
                f"positions [{header.start}, {header.start + header.num_tokens}); "
                f"expected [{prefix}, {n})"
            )
        elif header.num_tokens and (list(k.shape) != want_k or list(v.shape) != want_v):
            problem = (  # another model behind the prefill server
                f"K/V of shape {list(k.shape)} / {list(v.shape)}; this server's pool needs "
                f"{want_k} / {want_v}"
            )
        if problem is not None:
            self._release(req)
            self.output.finish_with_error(
                req, f"prefill server sent KV for {problem}", status_code=502
            )
            return False
        if header.num_tokens:
            import torch  # the pool's side; the request's slots are numpy on the host

            slots = torch.from_numpy(req.new_slots).to(self.kv_pool.k_buffers[0].device)
            for layer, (kb, vb) in enumerate(zip(self.kv_pool.k_buffers, self.kv_pool.v_buffers)):
                kb[slots] = k[layer].to(kb.device, kb.dtype)
                vb[slots] = v[layer].to(vb.device, vb.dtype)
        self.stats["disagg_transfers"] += 1
        self.stats["disagg_kv_tokens"] += header.num_tokens
        self.stats["disagg_kv_bytes"] += 0 if k is None else k.nbytes + v.nbytes
        self.stats["prompt_tokens"] += n
        self.stats["cached_tokens"] += prefix
        req.prompt_counted = True
        if req.return_logprob and header.input_token_logprobs is not None:
            req.logprob.input_token_logprobs = list(header.input_token_logprobs)
            req.logprob.input_top_logprobs = list(header.input_top_logprobs or [])
        return True

    def _cancel(self, req: Req, reason: str) -> None:
        self._release(req)
        self.transfer.send_control(_bootstrap_addr(req), KVCancel(req.bootstrap_room, reason))

    def _release(self, req: Req) -> None:
        """Free the request's slots without caching them (their KV was never written)."""
        self.kv.release(req, insert=False)
        req.reset_kv()


def _bootstrap_addr(req: Req) -> str:
    host, port = req.bootstrap_host, req.bootstrap_port
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6
    return f"tcp://{host}:{port}"
