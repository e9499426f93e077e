"""A backend that talks to a running server over SGLang's native HTTP API (works against a
loom server or an SGLang one)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from loom.backends.native import NativeBackend
from loom.chat_template import from_tokenizer, get_chat_template, match_by_text


class RuntimeEndpoint(NativeBackend):
    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        verify: Any = None,
        chat_template_name: str | None = None,
        timeout: float | None = None,
    ):
        import requests

        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.verify = verify
        self.timeout = timeout
        self._session = requests.Session()
        self.model_info = self._get("/get_model_info")
        if chat_template_name:
            self.chat_template = get_chat_template(chat_template_name)
        else:
            self.chat_template = _template_for_path(self.model_info.get("model_path") or "")

    # ------------------------------------------------------------------ http
    def _headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _check(self, res) -> None:
        if res.status_code >= 400:
            try:
                message = res.json().get("error", {}).get("message") or res.text
            except ValueError:
                message = res.text
            raise RuntimeError(f"{self.base_url}: HTTP {res.status_code}: {message}")

    def _get(self, path: str) -> dict:
        res = self._session.get(
            self.base_url + path, headers=self._headers(), verify=self.verify, timeout=self.timeout
        )
        self._check(res)
        return res.json()

    def _post(self, path: str, body: dict, stream: bool = False):
        res = self._session.post(
            self.base_url + path,
            json=body,
            headers=self._headers(),
            verify=self.verify,
            timeout=self.timeout,
            stream=stream,
        )
        self._check(res)
        return res

    # ------------------------------------------------------------------ primitives
    def _request(self, body: dict) -> dict | list[dict]:
        return self._post("/generate", body).json()

    def _request_stream(self, body: dict) -> Iterator[dict]:
        res = self._post("/generate", {**body, "stream": True}, stream=True)
        with res:
            for line in res.iter_lines(decode_unicode=True):
                if not line or not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                item = json.loads(data)
                if "error" in item:
                    raise RuntimeError(f"{self.base_url}: {item['error']}")
                yield item

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return self._post("/tokenize", {"prompt": list(texts)}).json()["tokens"]

    # ------------------------------------------------------------------ control
    def flush_cache(self) -> bool:
        return self._post("/flush_cache", {}).status_code == 200

    def pin_prefix(self, name: str, text: str) -> dict:
        res = self._post("/pin_prefix", {"name": name, "text": text})
        self._check(res)
        return res.json()

    def list_pinned(self) -> list[dict]:
        return self._get("/list_pinned")["pinned"]

    def get_server_info(self) -> dict:
        return self._get("/get_server_info")

    def get_model_info(self) -> dict:
        return self.model_info


def _template_for_path(model_path: str):
    """The model's own template when its folder is readable here, else a built-in by name."""
    if model_path:
        try:
            from loom.runtime.tokenizer import load_tokenizer

            return from_tokenizer(load_tokenizer(model_path))
        except Exception:  # noqa: BLE001 - a remote path or a hub name: match by name
            pass
    return match_by_text(model_path)
