"""Requests whose grammar is compiling, off the scheduler thread.

A request with a regex / json_schema / ebnf constraint waits here until its compile future is
done; a compile error or a compile slower than `--grammar-compile-timeout` finishes the request
with that error (status 400) and never blocks the others.
"""

from __future__ import annotations

import time
from concurrent.futures import Future

from loom.runtime.req import Req


class GrammarQueue:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, timeout: float):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.timeout = timeout
        self._backend = None
        self.pending: list[tuple[Req, Future, float]] = []

    @property
    def backend(self):
        if self._backend is None:
            from loom.grammar.backend import GrammarBackend

            self._backend = GrammarBackend(self.tokenizer, self.vocab_size, set(self.eos_token_ids))
        return self._backend

    def __len__(self) -> int:
        return len(self.pending)

    def add(self, req: Req, kind: str, spec: str) -> str | None:
        """Start compiling; returns an error message when it cannot even start."""
        if self.tokenizer is None:
            return f"{kind}: grammar-constrained decoding needs the tokenizer (skip_tokenizer_init is set)"
        self.pending.append(
            (req, self.backend.compile_async(kind, spec), time.monotonic() + self.timeout)
        )
        return None

    def poll(self) -> tuple[list[Req], list[tuple[Req, str]]]:
        """(requests now ready, (request, error) pairs); both leave the queue."""
        ready, failed, still = [], [], []
        now = time.monotonic()
        for req, fut, deadline in self.pending:
            if fut.done():
                try:
                    req.grammar = fut.result()
                    ready.append(req)
                except Exception as e:  # noqa: BLE001 - any compile failure is the request's error
                    kind = (req.sampling_params.grammar_spec or ("grammar",))[0]
                    failed.append((req, f"{kind}: {e}"))
            elif now > deadline:
                fut.cancel()
                kind = (req.sampling_params.grammar_spec or ("grammar",))[0]
                failed.append((req, f"{kind}: compiling took longer than {self.timeout:g} s"))
            else:
                still.append((req, fut, deadline))
        self.pending = still
        return ready, failed

    def remove(self, rid: str) -> list[Req]:
        gone = [r for r, _, _ in self.pending if rid in ("", r.rid)]
        self.pending = [p for p in self.pending if p[0] not in gone]
        return gone
