"""The scheduler's door to grammars: compile by kind, cache by spec, compile off-thread.

    backend = GrammarBackend(tokenizer, vocab_size=model_config.vocab_size)
    fut = backend.compile_async("json_schema", schema)   # on request admission
    grammar = fut.result(timeout=...)                      # when the request is scheduled

Kinds: "regex", "json_schema", "choices", "ebnf" (GBNF, `root ::= ...`) and "lark". Compiled
grammars are cached by (kind, normalized spec); callers get `.copy()`s, which share the
compiled tables. A failed compile is cached too, so a bad spec fails fast every time.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .base import Grammar, GrammarError
from .json_schema import JsonSchemaOptions, compile_json_schema, normalize_schema
from .vocab import TokenVocabulary

log = logging.getLogger(__name__)
KINDS = ("regex", "json_schema", "ebnf", "lark", "choices")


class GrammarBackend:
    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int | None = None,
        eos_token_ids=None,
        *,
        json_options: JsonSchemaOptions | None = None,
        max_workers: int = 2,
        cache_size: int = 256,
    ):
        self.vocab = TokenVocabulary.from_tokenizer(tokenizer, vocab_size, eos_token_ids)
        self.json_options = json_options or JsonSchemaOptions()
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple, Grammar | GrammarError] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="loom-grammar")
        self._inflight: dict[tuple, _Job] = {}

    @property
    def vocab_size(self) -> int:
        return self.vocab.vocab_size

    def compile(self, kind: str, spec: Any) -> Grammar:
        """A fresh grammar object for (kind, spec); raises GrammarError."""
        key = self._key(kind, spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
        if hit is None:
            hit = self._compile_and_cache(key, kind, spec)
        if isinstance(hit, GrammarError):
            raise GrammarError(str(hit))
        return hit.copy()

    def compile_async(self, kind: str, spec: Any) -> Future:
        """Compile on the backend's thread pool; the caller enforces the timeout.

        Each caller gets its own future (resolving to its own grammar copy); callers asking
        for a spec that is already compiling share that one compile. `fut.compile_started()`
        is the monotonic time the compile began, None while it waits for a worker."""
        out: Future = Future()
        try:
            key = self._key(kind, spec)
        except GrammarError as e:
            out.set_exception(e)
            out.compile_started = lambda: None
            return out
        with self._lock:
            hit = self._cache.get(key)
            job = None if hit is not None else self._inflight.get(key)
            if hit is None and job is None:
                job = self._inflight[key] = _Job()
                job.future = self._pool.submit(self._run_job, key, kind, spec, job)
        if hit is not None:
            out.compile_started = lambda: None
            _resolve(out, hit)
            return out
        out.compile_started = lambda: job.started
        job.future.add_done_callback(lambda f: _resolve(out, f.result()))
        return out

    def give_up(self, kind: str, spec: Any, message: str) -> None:
        """A compile ran past its caller's deadline: later requests for the spec fail fast with
        `message` instead of starting (or waiting on) another runaway compile. If the compile
        does finish, its result replaces this entry."""
        try:
            key = self._key(kind, spec)
        except GrammarError:
            return
        with self._lock:
            if key not in self._cache:
                self._cache[key] = GrammarError(message)

    def _compile_and_cache(self, key, kind: str, spec: Any) -> Grammar | GrammarError:
        """The compiled grammar, or the GrammarError saying why not; either is cached."""
        try:
            hit = self._compile(kind, spec)
        except GrammarError as e:
            hit = e
        except RecursionError:
            hit = GrammarError(f"{kind} spec nests too deeply")
        except Exception as e:  # an engine bug must not become a server error
            log.exception("grammar compile failed (%s)", kind)
            hit = GrammarError(f"cannot compile {kind}: {type(e).__name__}: {e}")
        with self._lock:
            self._cache[key] = hit
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return hit

    def _run_job(self, key, kind: str, spec: Any, job: _Job):
        job.started = time.monotonic()
        try:
            return self._compile_and_cache(key, kind, spec)
        finally:
            with self._lock:
                self._inflight.pop(key, None)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _key(self, kind: str, spec: Any) -> tuple:
        if kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {kind!r}; expected one of {KINDS}")
        if kind == "json_schema":
            return kind, json.dumps(normalize_schema(spec), sort_keys=True)
        if kind == "choices":
            if isinstance(spec, str) or not isinstance(spec, (list, tuple)):
                raise GrammarError("choices must be a list of strings")
            return kind, tuple(spec)
        if not isinstance(spec, str):
            raise GrammarError(f"a {kind} grammar must be a string, got {type(spec).__name__}")
        return kind, spec

    def _compile(self, kind: str, spec: Any) -> Grammar:
        vocab = self.vocab
        if kind == "regex":
            from .regex_grammar import CompiledRegex, RegexGrammar

            return RegexGrammar(CompiledRegex(spec, vocab))
        if kind == "json_schema":
            return compile_json_schema(spec, vocab, self.json_options)
        if kind == "choices":
            from .choices import compile_choices

            return compile_choices(list(spec), vocab)
        try:
            from . import ebnf
        except ImportError as e:  # pragma: no cover - the CFG engine ships separately
            raise GrammarError(f"the {kind} engine is not available: {e}") from None
        fn = getattr(ebnf, "compile_gbnf" if kind == "ebnf" else "compile_lark", None)
        if fn is None:
            raise GrammarError(f"the {kind} engine is not available yet")
        return fn(spec, vocab)


class _Job:
    """One compile in flight, shared by every caller that asked for its spec meanwhile."""

    def __init__(self):
        self.started: float | None = None
        self.future: Future | None = None


def _resolve(out: Future, hit) -> None:
    if isinstance(hit, GrammarError):
        out.set_exception(GrammarError(str(hit)))
    else:
        out.set_result(hit.copy())
