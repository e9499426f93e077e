"""A backend for any OpenAI-compatible endpoint (OpenAI itself, a loom or SGLang server's /v1,
vLLM, ...), through the `openai` client.

Chat models receive the state's messages (gens belong inside `with s.assistant():`);
completion models receive the text. `select` scores each choice by the prompt
log-probabilities the endpoint echoes back on /v1/completions (`echo=True, logprobs=0,
max_tokens=0`), from the earliest character where any choice's tokens leave the shared prompt
(token healing by text offsets). That needs a completion model, or a chat model whose
`chat_template` is given (the state's text is then the rendered conversation). Otherwise (or
when the endpoint refuses) the model generates greedily and the choice closest to its output
is taken, so the value is still always one of the choices.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from loom.backends.base import BaseBackend, Completion
from loom.chat_template import get_chat_template
from loom.choices import ChoicesDecision
from loom.ir import SglSamplingParams

# Model names served only by the legacy completions API.
_COMPLETION_MODELS = ("gpt-3.5-turbo-instruct", "davinci-002", "babbage-002")


class OpenAI(BaseBackend):
    def __init__(
        self,
        model_name: str,
        is_chat_model: bool | None = None,
        chat_template: Any = None,
        base_url: str | None = None,
        api_key: str | None = None,
        client: Any = None,
        **client_kwargs: Any,
    ):
        if client is None:
            import openai

            client = openai.OpenAI(
                base_url=base_url,
                api_key=api_key or os.environ.get("OPENAI_API_KEY", "EMPTY"),
                **client_kwargs,
            )
        self.client = client
        self.model_name = model_name
        if is_chat_model is None:
            is_chat_model = model_name not in _COMPLETION_MODELS
        self.is_chat_model = is_chat_model
        # With a chat model, the state's text is the conversation rendered by this template;
        # given the model's real template, select can score that text on /v1/completions.
        self.echo_logprobs = not is_chat_model or chat_template is not None
        if isinstance(chat_template, str):
            chat_template = get_chat_template(chat_template)
        self.chat_template = chat_template or get_chat_template("default")

    # ------------------------------------------------------------------ requests
    @staticmethod
    def _kwargs(params: SglSamplingParams) -> dict:
        sampling, fields = params.to_native()
        kwargs: dict[str, Any] = {
            "max_tokens": sampling["max_new_tokens"],
            "temperature": sampling["temperature"],
            "top_p": sampling["top_p"],
            "frequency_penalty": sampling["frequency_penalty"],
            "presence_penalty": sampling["presence_penalty"],
            "n": sampling["n"],
        }
        if sampling["stop"]:
            kwargs["stop"] = sampling["stop"]
        # Extensions understood by SGLang-, loom- and vLLM-style servers.
        extra = {
            k: sampling[k]
            for k in (
                "top_k",
                "min_p",
                "regex",
                "json_schema",
                "ignore_eos",
                "stop_token_ids",
                "stop_regex",
            )  # fmt: skip
            if k in sampling and sampling[k] not in (None, -1, 0.0, False, [])
        }
        if sampling.get("min_new_tokens"):
            extra["min_tokens"] = sampling["min_new_tokens"]
        if extra:
            kwargs["extra_body"] = extra
        if fields.get("return_logprob"):
            kwargs["logprobs"] = True
            if fields.get("top_logprobs_num"):
                kwargs["top_logprobs"] = fields["top_logprobs_num"]
        return kwargs

    def _chat_messages(self, prompt: str, messages: list[dict] | None) -> list[dict]:
        return list(messages) if messages else [{"role": "user", "content": prompt}]

    def _create(self, prompt, params, messages, stream=False):
        kwargs = self._kwargs(params)
        if self.is_chat_model:
            return self.client.chat.completions.create(
                model=self.model_name,
                messages=self._chat_messages(prompt, messages),
                stream=stream,
                **kwargs,
            )
        if kwargs.pop("logprobs", False):
            kwargs["logprobs"] = kwargs.pop("top_logprobs", 0)
        return self.client.completions.create(
            model=self.model_name, prompt=prompt, stream=stream, **kwargs
        )

    def _text(self, choice: Any) -> str:
        if self.is_chat_model:
            return choice.message.content or ""
        return choice.text or ""

    @staticmethod
    def _meta(resp: Any, choice: Any) -> dict:
        usage = getattr(resp, "usage", None)
        return {
            "id": getattr(resp, "id", None),
            "prompt_tokens": getattr(usage, "prompt_tokens", None),
            "completion_tokens": getattr(usage, "completion_tokens", None),
            "finish_reason": getattr(choice, "finish_reason", None),
            "logprobs": getattr(choice, "logprobs", None),
        }

    def generate(self, prompt, params, messages=None) -> Completion:
        resp = self._create(prompt, params, messages)
        texts = [self._text(c) for c in resp.choices]
        metas = [self._meta(resp, c) for c in resp.choices]
        if (params.n or 1) > 1:
            return texts, metas
        return texts[0], metas[0]

    def generate_stream(self, prompt, params, messages=None) -> Iterator[tuple[str, dict]]:
        if (params.n or 1) > 1:
            yield self.generate(prompt, params, messages)
            return
        text, meta = "", {}
        for chunk in self._create(prompt, params, messages, stream=True):
            if not chunk.choices:
                continue
            c = chunk.choices[0]
            delta = (c.delta.content if self.is_chat_model else c.text) or ""
            text += delta
            meta = {"id": getattr(chunk, "id", None), "finish_reason": c.finish_reason}
            yield text, meta

    # ------------------------------------------------------------------ select
    def select(
        self, prompt, choices, temperature, choices_method, messages=None
    ) -> ChoicesDecision:
        if self.echo_logprobs and not choices_method.requires_unconditional_logprobs:
            try:
                return self._select_by_echo(prompt, choices, choices_method)
            except Exception:  # noqa: BLE001 - an endpoint without echoed logprobs
                self.echo_logprobs = False
        return self._select_by_generation(prompt, choices, messages)

    def _select_by_echo(self, prompt, choices, method) -> ChoicesDecision:
        resp = self.client.completions.create(
            model=self.model_name,
            prompt=[prompt + c for c in choices],
            max_tokens=0,
            echo=True,
            logprobs=0,
            temperature=0,
        )
        rows = sorted(resp.choices, key=lambda c: c.index)
        # The earliest character where some choice's tokens leave the shared prompt.
        start = len(prompt)
        for row in rows:
            lp = row.logprobs
            for tok, off in zip(lp.tokens, lp.text_offset):
                if off + len(tok) > len(prompt):
                    start = min(start, off)
                    break
        scored = []
        for row in rows:
            lp = row.logprobs
            scored.append(
                [
                    [v, None, t]
                    for t, v, off in zip(lp.tokens, lp.token_logprobs, lp.text_offset)
                    if off >= start and v is not None
                ]
            )
        normalized = [sum(t[0] for t in s) / len(s) if s else float("-inf") for s in scored]
        return method(
            choices=choices,
            normalized_prompt_logprobs=normalized,
            input_token_logprobs=scored,
            output_token_logprobs=[[] for _ in choices],
        )

    def _select_by_generation(self, prompt, choices, messages) -> ChoicesDecision:
        params = SglSamplingParams(max_new_tokens=max(16, max(len(c) for c in choices)))
        params.temperature = 0.0
        text, _ = self.generate(prompt, params, messages)
        out = text.strip()
        for c in choices:
            if out == c.strip():
                return ChoicesDecision(c, {"generated": text})

        def overlap(c: str) -> int:
            n = 0
            for x, y in zip(out, c.strip()):
                if x != y:
                    break
                n += 1
            return n

        best = max(choices, key=overlap)  # first of equals
        return ChoicesDecision(best, {"generated": text})
