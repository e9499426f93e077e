"""The router's HTTP app: SGLang's native API and the OpenAI API in front of several workers.

Generation routes (/generate, /v1/completions, /v1/chat/completions) go to the worker the
policy picks, streams passed through byte for byte; read-only routes (/v1/models,
/model_info, /tokenize, ...) go to any worker; /flush_cache and /abort_request go to all.
Admin: /add_worker?url=, /remove_worker?url=, /list_workers; /get_server_info adds each
worker's load and cache hit rate; /metrics is Prometheus text with per-worker series.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import time

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from loom.runtime.router.args import RouterArgs
from loom.runtime.router.metrics import _decisions, merge_worker_metrics, render_metrics
from loom.runtime.router.policy import make_policy
from loom.runtime.router.proxy import Proxy, error_response, parse_body, routing_key
from loom.runtime.router.workers import WorkerPool
from loom.runtime.server.disconnect import unless_disconnected

_GENERATE_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")
_ANY_WORKER_GET = (
    "/v1/models",
    "/model_info",
    "/get_model_info",
    "/health_generate",
    "/list_pinned",  # pin records live in the shared L3: any replica lists them all
)
_ANY_WORKER_POST = ("/tokenize", "/detokenize")
# /get_server_info: reported per worker, and summed over the pool at the top level
_PER_WORKER = ("num_running_reqs", "num_waiting_reqs", "cache_hit_rate", "max_total_tokens")
_SUMMED = (
    "num_running_reqs",
    "num_waiting_reqs",
    "max_total_tokens",
    "kv_available_tokens",
    "cache_size_tokens",
    "prompt_tokens",
    "cached_tokens",
    "generated_tokens",
    "num_retractions",
)


@dataclasses.dataclass
class RouterMetrics:
    retries: int = 0
    started: float = dataclasses.field(default_factory=time.time)


def create_app(args: RouterArgs) -> FastAPI:
    def new_policy():
        return make_policy(
            args.policy,
            cache_threshold=args.cache_threshold,
            balance_abs_threshold=args.balance_abs_threshold,
            balance_rel_threshold=args.balance_rel_threshold,
            max_tree_size=args.max_tree_size,
        )

    pool = WorkerPool(new_policy(), args.all_worker_urls)
    metrics = RouterMetrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        timeout = httpx.Timeout(args.request_timeout, connect=args.health_check_timeout)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            app.state.proxy = Proxy(pool, client, metrics, args.health_check_timeout)
            if args.pd_disaggregation:
                from loom.runtime.router.pd import PDProxy

                app.state.pd = PDProxy(pool, args, new_policy, client)
            health = asyncio.create_task(
                pool.health_loop(
                    client,
                    args.health_check_interval,
                    args.health_check_timeout,
                    args.health_failure_threshold,
                )
            )
            try:
                yield
            finally:
                health.cancel()

    app = FastAPI(title="loom router", lifespan=lifespan)
    app.state.pool = pool
    app.state.args = args

    if args.api_key:
        expected = f"Bearer {args.api_key}".encode()

        @app.middleware("http")
        async def require_key(request: Request, call_next):
            if request.url.path not in ("/health", "/metrics"):
                got = request.headers.get("authorization", "").encode()
                if not hmac.compare_digest(got, expected):
                    return error_response(401, "authorization: missing or wrong API key")
            return await call_next(request)

    def proxy(request: Request) -> Proxy:
        return request.app.state.proxy

    async def generate(request: Request):
        raw = await request.body()
        body = parse_body(raw)
        path = request.url.path
        stream = isinstance(body, dict) and bool(body.get("stream"))
        if args.pd_disaggregation:
            forward = request.app.state.pd.forward(
                path, body, request.headers, stream, routing_key(path, body)
            )
        else:
            forward = proxy(request).forward(
                "POST", path, raw, request.headers, stream, routing_key(path, body)
            )
        if stream:  # a stream's client leaving closes the generator, and so the upstream
            return await forward
        return await unless_disconnected(
            request, forward, lambda: error_response(499, "client disconnected")
        )

    for path in _GENERATE_ROUTES:
        app.add_api_route(path, generate, methods=["POST"])

    async def any_worker(request: Request):
        raw = await request.body()
        return await proxy(request).forward(
            request.method, request.url.path, raw, request.headers, False, None
        )

    for path in _ANY_WORKER_GET:
        app.add_api_route(path, any_worker, methods=["GET"])
    for path in _ANY_WORKER_POST:
        app.add_api_route(path, any_worker, methods=["POST"])

    @app.get("/health")
    async def health():
        if not pool.workers:
            return error_response(503, "no healthy worker")
        return PlainTextResponse("OK\n")

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    @app.post("/abort_request")
    async def to_all(request: Request):
        raw = await request.body()
        results = await proxy(request).broadcast("POST", request.url.path, raw, request.headers)
        failed = [f"{url}: {status} {text[:200]}" for url, status, text in results if status >= 300]
        if failed:
            return error_response(502, f"{request.url.path} failed on " + "; ".join(failed))
        if request.url.path == "/flush_cache":
            return PlainTextResponse("Cache flushed.\n")
        return JSONResponse({"workers": [url for url, _, _ in results]})

    @app.post("/pin_prefix")
    @app.post("/unpin_prefix")
    async def pin_all(request: Request):
        """Every replica pins (the first prefills it and writes it to the shared L3 before it
        answers; the others load it from there): each keeps its own copy locked."""
        raw = await request.body()
        results = await proxy(request).broadcast("POST", request.url.path, raw, request.headers)
        for url, status, text in results:
            if status >= 300:
                return error_response(status if status < 500 else 502, f"{url}: {text[:500]}")
        if not results:
            return error_response(503, "no healthy worker")
        body = json.loads(results[0][2])
        return JSONResponse({**body, "workers": [url for url, _, _ in results]})

    @app.get("/list_workers")
    async def list_workers():
        return pool.listing()

    @app.post("/add_worker")
    async def add_worker(request: Request, url: str | None = None):
        if not url:
            return error_response(400, "url: required (POST /add_worker?url=http://host:port)")
        if args.pd_disaggregation:
            return error_response(
                400, "url: /add_worker is not supported with --pd-disaggregation yet"
            )
        try:
            worker_url = url.strip().rstrip("/")
            res = await proxy(request).client.get(
                worker_url + "/health", timeout=args.health_check_timeout
            )
            if res.status_code != 200:
                return error_response(400, f"url: {url} /health answered {res.status_code}")
            worker = pool.add(worker_url)
        except ValueError as e:
            return error_response(400, str(e))
        except httpx.HTTPError as e:
            return error_response(400, f"url: {url} is not reachable ({type(e).__name__}: {e})")
        return {"added": worker.url, **pool.listing()}

    @app.post("/remove_worker")
    async def remove_worker(url: str | None = None):
        worker = pool.remove((url or "").strip().rstrip("/"), "removed through /remove_worker")
        if worker is None:
            return error_response(404, f"url: {url!r} is not a worker of this router")
        return {"removed": worker.url, **pool.listing()}

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info(request: Request):
        """The first worker's info with the pool's loads and KV summed (so a client sees one
        server), plus each worker's load and cache hit rate."""
        client = proxy(request).client
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}

        async def one(worker) -> tuple[dict, dict]:
            out = worker.summary()
            try:
                res = await client.get(worker.url + "/server_info", headers=headers, timeout=10)
                info = res.json() if res.status_code == 200 else {}
                for name in _PER_WORKER:
                    out[name] = info.get(name)
            except (httpx.HTTPError, ValueError) as e:
                info, out["error"] = {}, f"{type(e).__name__}: {e}"
            return info, out

        answers = await asyncio.gather(*(one(w) for w in pool.healthy()))
        infos = [info for info, _ in answers if info]
        merged = dict(infos[0]) if infos else {}
        for name in _SUMMED:
            if all(isinstance(i.get(name), int) for i in infos) and infos:
                merged[name] = sum(i[name] for i in infos)
        if isinstance(merged.get("prompt_tokens"), int) and len(infos) > 1:
            merged["cache_hit_rate"] = merged["cached_tokens"] / max(1, merged["prompt_tokens"])
            merged["internal_states"] = [s for i in infos for s in i.get("internal_states", [])]
        return {
            **merged,
            "router": {"policy": args.policy, **_decisions(pool)},
            "workers": [out for _, out in answers],
            "removed": [w.summary() for w in pool.removed.values()],
        }

    @app.get("/metrics")
    async def prometheus(request: Request):
        client = proxy(request).client

        async def one(worker) -> tuple[str, str]:
            try:
                res = await client.get(worker.url + "/metrics", timeout=10)
                return worker.url, res.text if res.status_code == 200 else ""
            except httpx.HTTPError:
                return worker.url, ""  # a worker without --enable-metrics, or gone

        texts = await asyncio.gather(*(one(w) for w in pool.healthy()))
        body = render_metrics(pool, metrics) + merge_worker_metrics(texts)
        return PlainTextResponse(body, media_type="text/plain")

    return app
