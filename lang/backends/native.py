"""Backends that speak SGLang's native generate API (Engine in-process, RuntimeEndpoint over
HTTP). Everything above four primitives lives here once: request bodies, streaming, prefix
caching and `select` scoring.

`select` scores each choice by the exact log-probabilities of its own tokens. The prompt and
prompt+choice are tokenized; where a choice's tokenization diverges from the prompt's (token
healing: "is " + "Paris" may become "is" + " Paris") all choices are scored from the earliest
divergence, so every choice is P(its text | the same prefix tokens). One batched, prefill-only
request carries every prompt+choice with `logprob_start_len` at that boundary, so the prefix
is computed once and shared in the radix cache.
"""

from __future__ import annotations

import asyncio
import threading
from abc import abstractmethod
from collections.abc import AsyncIterator, Iterator
from typing import Any

from loom.backends.base import BaseBackend, Completion
from loom.choices import ChoicesDecision, ChoicesSamplingMethod
from loom.global_config import global_config
from loom.ir import SglSamplingParams


class NativeBackend(BaseBackend):
    supports_prefix_cache = True

    # ------------------------------------------------------------------ primitives
    @abstractmethod
    def _request(self, body: dict) -> dict | list[dict]:
        """One /generate call (not streaming)."""

    @abstractmethod
    def _request_stream(self, body: dict) -> Iterator[dict]:
        """One streaming /generate call: cumulative outputs."""

    @abstractmethod
    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Token ids exactly as the runtime tokenizes a text prompt (special tokens included)."""

    async def _arequest(self, body: dict) -> dict | list[dict]:
        return await asyncio.to_thread(self._request, body)

    async def _arequest_stream(self, body: dict) -> AsyncIterator[dict]:
        async for item in _iterate_in_thread(lambda: self._request_stream(body)):
            yield item

    async def atokenize(self, texts: list[str]) -> list[list[int]]:
        return await asyncio.to_thread(self.tokenize, texts)

    # ------------------------------------------------------------------ generate
    @staticmethod
    def _gen_body(prompt: str, params: SglSamplingParams) -> dict:
        sampling, fields = params.to_native()
        sampling["skip_special_tokens"] = global_config.skip_special_tokens_in_output
        sampling["spaces_between_special_tokens"] = (
            global_config.spaces_between_special_tokens_in_out
        )
        return {"text": prompt, "sampling_params": sampling, **fields}

    @staticmethod
    def _completion(out: dict | list[dict]) -> Completion:
        if isinstance(out, list):
            return [o["text"] for o in out], [o["meta_info"] for o in out]
        return out["text"], out["meta_info"]

    def generate(self, prompt, params, messages=None) -> Completion:
        return self._completion(self._request(self._gen_body(prompt, params)))

    async def agenerate(self, prompt, params, messages=None) -> Completion:
        return self._completion(await self._arequest(self._gen_body(prompt, params)))

    def generate_stream(self, prompt, params, messages=None) -> Iterator[tuple[str, dict]]:
        if (params.n or 1) > 1:  # n copies do not stream; they arrive whole
            yield self.generate(prompt, params, messages)
            return
        for out in self._request_stream(self._gen_body(prompt, params)):
            yield out["text"], out["meta_info"]

    async def agenerate_stream(self, prompt, params, messages=None):
        if (params.n or 1) > 1:
            yield await self.agenerate(prompt, params, messages)
            return
        async for out in self._arequest_stream(self._gen_body(prompt, params)):
            yield out["text"], out["meta_info"]

    # ------------------------------------------------------------------ prefix cache
    @staticmethod
    def _prefill_body(prompt: str) -> dict:
        return {"text": prompt, "sampling_params": {"max_new_tokens": 0}}

    def cache_prefix(self, prompt: str) -> None:
        if prompt:
            self._request(self._prefill_body(prompt))

    async def acache_prefix(self, prompt: str) -> None:
        if prompt:
            await self._arequest(self._prefill_body(prompt))

    # ------------------------------------------------------------------ select
    def select(self, prompt, choices, temperature, choices_method, messages=None):
        texts = _select_texts(prompt, choices, choices_method)
        plan = _SelectPlan(self.tokenize(texts), len(choices), choices_method)
        return plan.decide(choices, choices_method, self._request(plan.body))

    async def aselect(self, prompt, choices, temperature, choices_method, messages=None):
        texts = _select_texts(prompt, choices, choices_method)
        plan = _SelectPlan(await self.atokenize(texts), len(choices), choices_method)
        return plan.decide(choices, choices_method, await self._arequest(plan.body))


def _select_texts(prompt: str, choices: list[str], method: ChoicesSamplingMethod) -> list[str]:
    texts = [prompt] + [prompt + c for c in choices]
    if method.requires_unconditional_logprobs:
        texts.append("")  # what the tokenizer puts before any text (BOS or nothing)
    return texts


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class _SelectPlan:
    """The scoring request for one select, and how to read its answer."""

    def __init__(self, token_lists: list[list[int]], n: int, method: ChoicesSamplingMethod):
        prefix, fulls = token_lists[0], token_lists[1 : 1 + n]
        split = min(common_prefix_len(prefix, f) for f in fulls)
        if any(len(f) <= split for f in fulls):  # an empty choice: score one prefix token
            split = max(split - 1, 0)
        self.split = split
        self.n = n
        input_ids = [list(f) for f in fulls]
        starts = [split] * n
        if method.requires_unconditional_logprobs:
            lead = list(token_lists[1 + n])
            input_ids += [lead + list(f[split:]) for f in fulls]
            starts += [len(lead)] * n
        self.body = {
            "input_ids": input_ids,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": starts,
            "return_text_in_logprobs": True,
        }

    def decide(self, choices, method, outs: list[dict]) -> ChoicesDecision:
        metas = [o["meta_info"] for o in outs]
        cond = [[t for t in m["input_token_logprobs"] if t[0] is not None] for m in metas[: self.n]]
        normalized = [sum(t[0] for t in lp) / len(lp) if lp else 0.0 for lp in cond]
        uncond = (
            [m["input_token_logprobs"] for m in metas[self.n :]]
            if method.requires_unconditional_logprobs
            else None
        )
        decision = method(
            choices=choices,
            normalized_prompt_logprobs=normalized,
            input_token_logprobs=cond,
            output_token_logprobs=[m.get("output_token_logprobs", []) for m in metas[: self.n]],
            unconditional_token_logprobs=uncond,
        )
        if decision.decision not in choices:  # a method's bug must not leak a non-choice
            raise RuntimeError(f"select: method returned {decision.decision!r}, not a choice")
        decision.meta_info = {**(decision.meta_info or {}), "select_prefix_tokens": self.split}
        return decision


async def _iterate_in_thread(make_iter) -> AsyncIterator[Any]:
    """Drive a blocking iterator on a helper thread, yielding its items on this loop."""
    loop = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    def pump() -> None:
        try:
            for item in make_iter():
                loop.call_soon_threadsafe(q.put_nowait, item)
        except BaseException as e:  # noqa: BLE001 - re-raised on the loop
            loop.call_soon_threadsafe(q.put_nowait, e)
        loop.call_soon_threadsafe(q.put_nowait, done)

    threading.Thread(target=pump, daemon=True, name="loom-stream").start()
    while (item := await q.get()) is not done:
        if isinstance(item, BaseException):
            raise item
        yield item
