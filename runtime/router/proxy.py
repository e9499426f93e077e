"""Forwarding one request to a worker, with retries elsewhere when the worker fails.

A request is retried on another worker (never the same one twice) when nothing of it has
reached the client yet: the connection was refused or reset, the worker closed it before a
full response, or the worker answered 503 (its runtime died). Generation is a pure function of
the request, so re-running it elsewhere is safe. Once a stream has sent its first byte to the
client it cannot move: a failure then ends it with an SSE error event naming the worker.
Bodies travel untouched (the router parses a copy for the routing key only), so a worker's 4xx
for bad input reaches the client unchanged.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse

from loom.runtime.router.tree import ids_key
from loom.runtime.router.workers import Worker, WorkerPool

logger = logging.getLogger(__name__)

_FORWARDED_HEADERS = ("authorization", "content-type", "accept")


def error_response(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": status}}, status_code=status)


def _prompt_key(prompt) -> str | None:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, (str, list)):  # a batch: route by its first prompt
            return _prompt_key(first)
        if all(isinstance(i, int) for i in prompt):
            return ids_key(prompt)
    return None


def _chat_key(messages) -> str | None:
    if not isinstance(messages, list):
        return None
    parts = []
    for m in messages:
        if not isinstance(m, dict):
            return None
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(f"{m.get('role')}\n{content or ''}\n")
    return "".join(parts)


def routing_key(path: str, body) -> str | None:
    """The prompt the cache-aware policy matches: text, token ids or chat messages."""
    if not isinstance(body, dict):
        return None
    if path == "/generate":
        text = body.get("text")
        return _prompt_key(text if text is not None else body.get("input_ids"))
    if path == "/v1/completions":
        return _prompt_key(body.get("prompt"))
    if path == "/v1/chat/completions":
        return _chat_key(body.get("messages"))
    return None


def parse_body(raw: bytes):
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return None  # the worker answers the 400; the router does not second-guess it


def sse_error(message: str) -> bytes:
    event = {"error": {"message": message, "code": 502}}
    return f"data: {json.dumps(event)}\n\n".encode()


class Proxy:
    def __init__(
        self, pool: WorkerPool, client: httpx.AsyncClient, metrics, probe_timeout: float = 5.0
    ):
        self.pool = pool
        self.client = client
        self.metrics = metrics
        self.probe_timeout = probe_timeout
        self._probes: set[asyncio.Task] = set()

    def _fail(self, worker: Worker, why: str) -> None:
        """Count the failure and probe the worker in the background (the request moves on at
        once): it leaves the pool if /health fails too."""
        worker.failures += 1
        task = asyncio.ensure_future(
            self.pool.probe(self.client, worker, self.probe_timeout, 1, cause=why)
        )
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    async def forward(
        self, method: str, path: str, raw: bytes, headers, stream: bool, key: str | None
    ) -> Response:
        headers = {k: v for k, v in headers.items() if k.lower() in _FORWARDED_HEADERS}
        tried: set[str] = set()
        last_error = "no healthy worker"
        while True:
            worker = self.pool.pick(key, tried)
            if worker is None:
                return error_response(503, f"no worker could serve {path}: {last_error}")
            tried.add(worker.url)
            if len(tried) > 1:
                self.metrics.retries += 1
            worker.in_flight += 1
            handed_over = False
            try:
                request = self.client.build_request(
                    method, worker.url + path, content=raw, headers=headers
                )
                res = await self.client.send(request, stream=True)
                if res.status_code == 503:
                    await res.aread()
                    await res.aclose()
                    worker.failures += 1
                    last_error = f"{worker.url} answered 503: {res.text[:200]}"
                    continue
                worker.requests += 1
                if stream and res.status_code == 200:
                    handed_over = True
                    return StreamingResponse(
                        self._pump(res, worker),
                        status_code=200,
                        media_type=res.headers.get("content-type", "text/event-stream"),
                    )
                body = await res.aread()
                await res.aclose()
                return Response(
                    body,
                    status_code=res.status_code,
                    media_type=res.headers.get("content-type"),
                )
            except httpx.TimeoutException as e:
                return error_response(
                    504, f"{worker.url} did not answer {path} in time ({type(e).__name__})"
                )
            except httpx.TransportError as e:
                last_error = f"{worker.url} failed: {type(e).__name__}: {e}"
                self._fail(worker, f"request failed: {type(e).__name__}: {e}")
            finally:
                if not handed_over:
                    worker.in_flight -= 1

    async def _pump(self, res: httpx.Response, worker: Worker) -> AsyncIterator[bytes]:
        """A started stream: its bytes as they come; a worker failure ends it with an error
        event (the client already has part of the answer, so it cannot move)."""
        try:
            async for chunk in res.aiter_raw():
                yield chunk
        except httpx.TransportError as e:
            why = f"{type(e).__name__}: {e}"
            self._fail(worker, f"stream failed: {why}")
            yield sse_error(f"worker {worker.url} failed mid-stream ({why}); request not finished")
            yield b"data: [DONE]\n\n"
        finally:
            worker.in_flight -= 1
            await res.aclose()

    async def broadcast(self, method: str, path: str, raw: bytes, headers) -> list:
        """Send to every worker (flush_cache, abort_request); [(url, status or error)]."""
        headers = {k: v for k, v in headers.items() if k.lower() in _FORWARDED_HEADERS}
        out = []
        for worker in self.pool.healthy():
            try:
                res = await self.client.request(
                    method, worker.url + path, content=raw, headers=headers
                )
                out.append((worker.url, res.status_code, res.text))
            except httpx.TransportError as e:
                out.append((worker.url, 502, f"{type(e).__name__}: {e}"))
        return out
