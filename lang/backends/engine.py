"""The in-process backend: a `loom.Engine`, no HTTP."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

from loom.backends.native import NativeBackend
from loom.chat_template import ChatTemplate, from_tokenizer, get_chat_template


class EngineBackend(NativeBackend):
    """`EngineBackend(engine)` wraps a running Engine; `EngineBackend(model_path=..., **args)`
    starts (and owns) one."""

    def __init__(self, engine: Any = None, chat_template: str | None = None, **engine_args: Any):
        self._owns_engine = engine is None
        if engine is None:
            from loom.runtime.engine import Engine

            engine = Engine(**engine_args)
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.chat_template = _template_for(engine, chat_template)

    # ------------------------------------------------------------------ primitives
    @staticmethod
    def _kwargs(body: dict) -> dict:
        kwargs = dict(body)
        if "text" in kwargs:
            kwargs["prompt"] = kwargs.pop("text")
        return kwargs

    def _request(self, body: dict) -> dict | list[dict]:
        return self.engine.generate(**self._kwargs(body))

    def _request_stream(self, body: dict) -> Iterator[dict]:
        return self.engine.generate(**self._kwargs(body), stream=True)

    async def _arequest(self, body: dict) -> dict | list[dict]:
        return await self.engine.async_generate(**self._kwargs(body))

    async def _arequest_stream(self, body: dict) -> AsyncIterator[dict]:
        async for item in await self.engine.async_generate(**self._kwargs(body), stream=True):
            yield item

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        if self.tokenizer is None:
            raise RuntimeError("select: the engine was started with skip_tokenizer_init")
        return [self.tokenizer.encode(t) for t in texts]

    async def atokenize(self, texts: list[str]) -> list[list[int]]:
        return self.tokenize(texts)  # local and fast

    # ------------------------------------------------------------------ control
    def flush_cache(self) -> bool:
        return self.engine.flush_cache()

    def pin_prefix(self, name: str, text: str) -> dict:
        return self.engine.pin_prefix(name, text=text)

    def list_pinned(self) -> list[dict]:
        return self.engine.list_pinned()

    def get_server_info(self) -> dict:
        return self.engine.get_server_info()

    def shutdown(self) -> None:
        if self._owns_engine:
            self.engine.shutdown()


def _template_for(engine: Any, name: str | None) -> ChatTemplate:
    name = name or getattr(getattr(engine, "server_args", None), "chat_template", None)
    if name:
        try:
            return get_chat_template(name)
        except ValueError:
            pass  # a Jinja file path: the tokenizer carries the template the engine uses
    if engine.tokenizer is not None:
        return from_tokenizer(engine.tokenizer)
    return get_chat_template("default")


def as_backend(backend: Any) -> Any:
    """Accept a backend, an Engine or a Runtime (wrapped once, in an EngineBackend or a
    RuntimeEndpoint)."""
    if backend is None or isinstance(backend, NativeBackend):
        return backend
    if hasattr(backend, "tokenizer_manager") and hasattr(backend, "async_generate"):
        wrapped = getattr(backend, "_loom_lang_backend", None)
        if wrapped is None:
            wrapped = EngineBackend(backend)
            backend._loom_lang_backend = wrapped
        return wrapped
    if hasattr(backend, "endpoint"):  # SGLang's Runtime
        return backend.endpoint
    if hasattr(backend, "url") and hasattr(backend, "server_args"):  # loom's Runtime
        wrapped = getattr(backend, "_loom_lang_backend", None)
        if wrapped is None:
            from loom.backends.runtime_endpoint import RuntimeEndpoint

            wrapped = RuntimeEndpoint(backend.url, api_key=backend.server_args.api_key)
            backend._loom_lang_backend = wrapped
        return wrapped
    return backend


def resolve_backend(backend: Any):
    """`backend` as a backend object, or the default one (loom.set_default_backend)."""
    from loom.global_config import global_config

    backend = as_backend(backend if backend is not None else global_config.default_backend)
    if backend is None:
        raise ValueError("no backend: pass backend=... or call loom.set_default_backend(...) first")
    return backend
