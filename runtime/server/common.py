"""What the HTTP layer's modules share: the server state the routes read, the error with an
HTTP status, JSON that never fails on a non-finite float, and the public view of the server
args. The app and the routers (native.py, openai_api.py) import this module, not each other."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from typing import Any

from fastapi.responses import JSONResponse


@dataclasses.dataclass
class ServerState:
    """What the routes share: the args, the TokenizerManager and the runtime's facts."""

    args: Any
    tm: Any
    scheduler_info: dict
    procs: list = dataclasses.field(default_factory=list)
    chat_template: str | None = None
    metrics: Any = None
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    on_shutdown: Any = None  # called in the lifespan's shutdown (stops the child processes)

    @property
    def tokenizer(self):
        return self.tm.tokenizer

    @property
    def context_len(self) -> int:
        return self.tm.context_len


class APIError(Exception):
    """An error with an explicit HTTP status (404 model_not_found, 503, ...)."""

    def __init__(self, status_code: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.code = code


def _finite(obj: Any) -> Any:
    """-inf logprobs (masked tokens) become None: JSON has no infinities."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def json_dumps(obj: Any) -> str:
    try:
        return json.dumps(obj, ensure_ascii=False, allow_nan=False)
    except ValueError:
        return json.dumps(_finite(obj), ensure_ascii=False, allow_nan=False)


class JSONOut(JSONResponse):
    """JSON that never fails on a non-finite float."""

    def render(self, content: Any) -> bytes:
        return json_dumps(content).encode("utf-8")


def public_args(args) -> dict:
    """The server args as /get_server_info shows them: every field but the API key."""
    out = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.name != "extra"}
    out.pop("api_key", None)
    return out
