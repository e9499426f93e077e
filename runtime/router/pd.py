"""Prefill/decode disaggregation in the router: one prefill and one decode worker per request.

The router picks a prefill worker and a decode worker (each pool by the router's policy),
adds SGLang's bootstrap fields to the body (`bootstrap_host` / `bootstrap_port`: the prefill
server's KV bootstrap address; `bootstrap_room`: a random id that pairs the two halves) and
sends it to both at once: to the prefill server as a non-streaming request (it computes the
prompt's KV and first token and sends the KV to the decode server), to the decode server as it
came (streamed or not). The client gets the decode server's answer; with `return_logprob` on /generate the router
waits for the prefill answer too and prepends its `input_token_logprobs` to the decode
server's (an empty list: the decode server leaves the prompt's logprobs to its prefill peer)
for a single non-streamed generation, exactly as sglang-router merges them; batches and
streams carry the decode server's own copy.

Failures: a prefill request that fails (an error status, or its worker unreachable) cancels
the decode request (closing its connection aborts it there: its KV is freed and the prefill
side told) and the client gets the prefill side's error; a decode request that fails, or a
client that leaves, cancels the prefill request likewise. The servers' own timeouts
(--disaggregation-timeout) bound whatever the router cannot see.
"""

from __future__ import annotations

import asyncio
import json
import random
from urllib.parse import urlparse

import httpx
from fastapi.responses import Response, StreamingResponse

from loom.runtime.router.proxy import error_response, sse_error
from loom.runtime.router.workers import Worker, WorkerPool

_FORWARDED_HEADERS = ("authorization", "accept")


class PDProxy:
    def __init__(self, pool: WorkerPool, args, make_policy, client: httpx.AsyncClient):
        self.pool = pool  # every worker (health checks, admin routes)
        self.client = client
        self.prefill_policy = make_policy()
        self.decode_policy = make_policy()
        self.prefill_urls = [u for u, _ in args.prefill]
        self.decode_urls = list(args.decode)
        self.bootstrap_ports: dict[str, int] = {u: p for u, p in args.prefill if p is not None}
        self.rng = random.Random()
        self.transfers = 0

    def _pick(self, urls: list[str], policy, key: str | None) -> Worker | None:
        workers = [self.pool.workers[u] for u in urls if u in self.pool.workers]
        return policy.select(workers, key) if workers else None

    async def _bootstrap_port(self, worker: Worker, headers: dict) -> int:
        port = self.bootstrap_ports.get(worker.url)
        if port is None:
            res = await self.client.get(worker.url + "/get_server_info", headers=headers)
            info = res.json()
            if info.get("disaggregation_mode") != "prefill":
                raise ValueError(
                    f"{worker.url} is not a prefill server (disaggregation_mode "
                    f"{info.get('disaggregation_mode')!r})"
                )
            port = self.bootstrap_ports[worker.url] = int(info["disaggregation_bootstrap_port"])
        return port

    async def forward(self, path: str, body, headers, stream: bool, key: str | None) -> Response:
        if not isinstance(body, dict):
            return error_response(400, "body: a JSON object is required")
        headers = {k: v for k, v in headers.items() if k.lower() in _FORWARDED_HEADERS}
        prefill = self._pick(self.prefill_urls, self.prefill_policy, key)
        decode = self._pick(self.decode_urls, self.decode_policy, key)
        if prefill is None or decode is None:
            which = "prefill" if prefill is None else "decode"
            return error_response(503, f"no healthy {which} worker")
        try:
            port = await self._bootstrap_port(prefill, headers)
        except (httpx.HTTPError, ValueError, KeyError) as e:
            return error_response(502, f"prefill worker {prefill.url}: no bootstrap port ({e})")
        fields = {
            "bootstrap_host": urlparse(prefill.url).hostname,
            "bootstrap_port": port,
            "bootstrap_room": self.rng.getrandbits(63),
        }
        p_body = {**body, **fields, "stream": False}
        p_body.pop("stream_options", None)
        d_body = {**body, **fields}
        for w in (prefill, decode):
            w.in_flight += 1
            w.requests += 1
        p_task = asyncio.ensure_future(self._post(prefill, path, p_body, headers))
        d_req = self.client.build_request("POST", decode.url + path, json=d_body, headers=headers)
        d_task = asyncio.ensure_future(self.client.send(d_req, stream=True))
        handed_over = False
        try:
            await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_COMPLETED)
            failed = _prefill_failure(p_task, prefill)
            if failed is not None:  # before the decode side answered: cancel it
                return failed
            try:
                res = await d_task
            except httpx.HTTPError as e:
                return error_response(502, f"decode worker {decode.url} failed: {_why(e)}")
            merge = path == "/generate" and _wants_logprob(body)
            if res.status_code != 200 or not stream:
                data = await res.aread()
                await res.aclose()
                if res.status_code != 200:
                    await asyncio.wait({p_task}, timeout=1.0)
                    failed = _prefill_failure(p_task, prefill)
                    if failed is not None and res.status_code >= 500:
                        return failed  # the root cause
                elif merge:
                    await asyncio.wait({p_task})
                    failed = _prefill_failure(p_task, prefill)
                    if failed is not None:
                        return failed
                    data = json.dumps(_merged(p_task.result().json(), json.loads(data)))
                return Response(data, res.status_code, media_type=res.headers.get("content-type"))
            handed_over = True
            return StreamingResponse(
                self._pump(res, p_task, prefill, decode),
                media_type=res.headers.get("content-type", "text/event-stream"),
            )
        finally:
            if not handed_over:
                self._done(p_task, d_task, prefill, decode)

    async def _post(self, worker: Worker, path: str, body: dict, headers: dict) -> httpx.Response:
        return await self.client.post(worker.url + path, json=body, headers=headers)

    async def _pump(self, res, p_task, prefill: Worker, decode: Worker):
        """The decode stream, cut short with an error event if the prefill half fails."""
        chunks = res.aiter_raw().__aiter__()
        try:
            while True:
                nxt = asyncio.ensure_future(chunks.__anext__())
                waits = {nxt} if p_task.done() else {nxt, p_task}
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                if not nxt.done():
                    failed = _prefill_failure(p_task, prefill)
                    if failed is not None:
                        nxt.cancel()
                        message = json.loads(failed.body)["error"]["message"]
                        yield sse_error(message)
                        yield b"data: [DONE]\n\n"
                        return
                    await asyncio.wait({nxt})
                try:
                    yield nxt.result()
                except StopAsyncIteration:
                    return
                except httpx.HTTPError as e:
                    yield sse_error(f"decode worker {decode.url} failed mid-stream: {_why(e)}")
                    yield b"data: [DONE]\n\n"
                    return
        finally:
            await res.aclose()
            self._done(p_task, None, prefill, decode)

    def _done(self, p_task, d_task, prefill: Worker, decode: Worker) -> None:
        """Cancel what is still running (the server aborts it and frees its KV)."""
        for task in (p_task, d_task):
            if task is not None and not task.done():
                task.cancel()
        if d_task is not None and d_task.done() and not d_task.cancelled():
            if d_task.exception() is None:
                asyncio.ensure_future(d_task.result().aclose())
        prefill.in_flight -= 1
        decode.in_flight -= 1


def _wants_logprob(body: dict) -> bool:
    flag = body.get("return_logprob")
    return any(flag) if isinstance(flag, list) else bool(flag)


def _merged(prefill_out, decode_out):
    """The decode answer with the prefill answer's `input_token_logprobs` in front of its own,
    for a single generation (an object), which is all sglang-router merges; a batch's decode
    answers carry the prompt logprobs themselves."""
    if not isinstance(prefill_out, dict) or not isinstance(decode_out, dict):
        return decode_out
    meta = decode_out.get("meta_info")
    if not isinstance(meta, dict) or "input_token_logprobs" not in meta:
        return decode_out
    before = prefill_out.get("meta_info", {}).get("input_token_logprobs") or []
    meta["input_token_logprobs"] = before + (meta["input_token_logprobs"] or [])
    return decode_out


def _why(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"


def _prefill_failure(task: asyncio.Future, worker: Worker) -> Response | None:
    """The prefill half's error as the client's answer, or None (still running, or fine)."""
    if not task.done() or task.cancelled():
        return None
    if task.exception() is not None:
        return error_response(502, f"prefill worker {worker.url} failed: {_why(task.exception())}")
    res = task.result()
    if res.status_code == 200:
        return None
    try:
        message = res.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = res.text[:500]
    return error_response(res.status_code, f"prefill worker {worker.url}: {message}")
