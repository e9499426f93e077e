"""The backend contract the interpreter calls. Prompts are the state's text (and, for chat
APIs, its messages); sampling parameters arrive resolved (`SglSamplingParams`)."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterator
from typing import Any

from loom.chat_template import ChatTemplate, get_chat_template
from loom.choices import ChoicesDecision, ChoicesSamplingMethod
from loom.ir import SglSamplingParams

# (text or list of texts for n > 1, meta_info or list of meta_info)
Completion = tuple[Any, Any]


class BaseBackend(ABC):
    chat_template: ChatTemplate = get_chat_template("default")
    # Whether `cache_prefix` makes later requests sharing the prefix cheaper.
    supports_prefix_cache = False

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    # ------------------------------------------------------------------ sync
    @abstractmethod
    def generate(
        self, prompt: str, params: SglSamplingParams, messages: list[dict] | None = None
    ) -> Completion: ...

    def generate_stream(
        self, prompt: str, params: SglSamplingParams, messages: list[dict] | None = None
    ) -> Iterator[tuple[str, dict]]:
        """(text generated so far, meta_info so far) pairs; by default one final chunk."""
        text, meta = self.generate(prompt, params, messages)
        yield text, meta

    @abstractmethod
    def select(
        self,
        prompt: str,
        choices: list[str],
        temperature: float,
        choices_method: ChoicesSamplingMethod,
        messages: list[dict] | None = None,
    ) -> ChoicesDecision: ...

    def cache_prefix(self, prompt: str) -> None:
        """Prefill `prompt` without generating, so requests extending it reuse its KV."""
        return None

    def flush_cache(self) -> Any:
        return None

    def pin_prefix(self, name: str, text: str) -> dict:
        """Compute and pin `text`'s KV on the server under `name` (CAG)."""
        raise NotImplementedError(f"{type(self).__name__} has no pinned prefixes")

    def list_pinned(self) -> list[dict]:
        raise NotImplementedError(f"{type(self).__name__} has no pinned prefixes")

    def pinned_text(self, name: str) -> str:
        """The text pinned under `name` (what `loom.pinned(name)` appends)."""
        for rec in self.list_pinned():
            if rec["name"] == name:
                if rec.get("text") is None:
                    raise ValueError(f"pinned prefix {name!r} was pinned by input_ids, no text")
                return rec["text"]
        raise ValueError(f"no prefix pinned as {name!r}")

    def get_server_info(self) -> dict:
        return {}

    def shutdown(self) -> None:
        return None

    # ------------------------------------------------------------------ async
    # Defaults run the sync call on a worker thread; backends with native async override.
    async def agenerate(self, prompt, params, messages=None) -> Completion:
        return await asyncio.to_thread(self.generate, prompt, params, messages)

    async def agenerate_stream(
        self, prompt, params, messages=None
    ) -> AsyncIterator[tuple[str, dict]]:
        text, meta = await self.agenerate(prompt, params, messages)
        yield text, meta

    async def aselect(self, prompt, choices, temperature, choices_method, messages=None):
        return await asyncio.to_thread(
            self.select, prompt, choices, temperature, choices_method, messages
        )

    async def apinned_text(self, name: str) -> str:
        return await asyncio.to_thread(self.pinned_text, name)

    async def acache_prefix(self, prompt: str) -> None:
        await asyncio.to_thread(self.cache_prefix, prompt)
