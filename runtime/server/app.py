"""The FastAPI application: error handling, auth, and the routers (the state and response types
the routes share are in server/common.py: the routers import it, not this module).

Every failure leaves as `{"error": {"message": ...}}`: 4xx for bad input (the message names
the field), 503 when a runtime process died, 500 only for genuine bugs (logged with a
traceback).
"""

from __future__ import annotations

import contextlib
import hmac
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from loom.runtime.request_normalizer import RequestError
from loom.runtime.server.common import APIError, ServerState

logger = logging.getLogger(__name__)

_AUTH_EXEMPT = ("/health", "/metrics")


def error_body(message: str, status: int, code: str | None = None) -> dict:
    kind = {
        400: "BadRequestError",
        401: "AuthenticationError",
        404: "NotFoundError",
        503: "ServiceUnavailableError",
    }.get(status, "InternalServerError" if status >= 500 else "InvalidRequestError")
    return {"error": {"message": message, "type": kind, "param": None, "code": code or status}}


def error_response(message: str, status: int, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, code), status_code=status)


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        field = ".".join(loc) or "body"
        if err.get("type") == "json_invalid":
            parts.append(f"body: malformed JSON ({err.get('ctx', {}).get('error', 'invalid')})")
        elif not loc and err.get("type") in ("missing", "model_attributes_type", "dict_type"):
            parts.append("body: a JSON object is required")
        else:
            parts.append(f"{field}: {err.get('msg', 'invalid value')}")
    return "; ".join(parts) or "body: invalid request"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return error_response(_validation_message(exc), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = f"{request.url.path}: no such route"
        return error_response(message, exc.status_code)

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError):
        return error_response(exc.message, exc.status_code, exc.code)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError):
        return error_response(str(exc), 400)

    @app.exception_handler(ValueError)
    async def _value_error(request: Request, exc: ValueError):
        return error_response(str(exc), 400)

    @app.exception_handler(RuntimeError)  # handled here, not re-raised to uvicorn's log
    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        state: ServerState = request.app.state.server
        if state.tm.dead_reason:
            return error_response(f"server unavailable: {state.tm.dead_reason}", 503)
        if isinstance(exc, TimeoutError):
            return error_response("the runtime did not answer in time", 503)
        logger.exception("internal error on %s %s", request.method, request.url.path)
        return error_response(f"internal server error: {type(exc).__name__}", 500)


class _AuthMiddleware:
    """Plain ASGI (not BaseHTTPMiddleware), so streaming and disconnects pass through as is."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if (
            scope["type"] == "http"
            and scope["method"] != "OPTIONS"
            and not scope["path"].startswith(_AUTH_EXEMPT)
        ):
            auth = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(auth, self.expected):  # constant time
                response = error_response(
                    "authorization: a valid 'Bearer <api key>' header is required", 401
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _BodyLimitMiddleware:
    """413 for a body over `limit` bytes: by its Content-Length at once, or while it streams
    in (chunked uploads), before the route has buffered it."""

    def __init__(self, app, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_big = (
            f"body: larger than the server's limit of {self.limit} bytes (--max-request-body-bytes)"
        )
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.limit:
            return await error_response(too_big, 413)(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise APIError(413, too_big)  # the route's error handler answers
            return message

        await self.app(scope, limited_receive, send)


def create_app(state: ServerState) -> FastAPI:
    from loom.runtime.server import native, openai_api
    from loom.runtime.version import __version__

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.tm.start()
        try:
            yield
        finally:
            from loom.runtime.server.tools import close_translators

            close_translators()
            with contextlib.suppress(Exception):
                await state.tm.close()
            if state.on_shutdown is not None:
                state.on_shutdown()

    app = FastAPI(title="loom", version=__version__, lifespan=lifespan)
    app.state.server = state
    install_error_handlers(app)

    if state.args.api_key:
        app.add_middleware(_AuthMiddleware, api_key=state.args.api_key)
    app.add_middleware(_BodyLimitMiddleware, limit=state.args.max_request_body_bytes)
    app.include_router(native.router)
    app.include_router(openai_api.router)
    if state.metrics is not None:
        from loom.runtime.server import metrics

        app.include_router(metrics.router)
    return app
