"""The scheduler's door to grammars: translate by kind, compile on an engine, cache by spec.

    backend = GrammarBackend(tokenizer, vocab_size=model_config.vocab_size, engine="llguidance")
    fut = backend.compile_async("json_schema", schema)   # on request admission
    grammar = fut.result(timeout=...)                      # when the request is scheduled

Kinds: "regex", "json_schema", "choices", "ebnf" (GBNF, `root ::= ...`) and "lark". A compile is
loom's translation (forms.py: spec -> a regex or a Lark grammar) followed by the engine's build
(engines/: llguidance by default, xgrammar, outlines) and the first mask. The engine, with its
view of the tokenizer, is built once per backend. Compiled grammars are cached by (kind,
normalized spec); callers get `.copy()`s. A failed compile is cached too, so a bad spec fails
fast every time.

Bounds: a spec longer than `max_spec_chars` is refused; with `compile_timeout` set, the
translation runs in a worker process (translation.py) that is killed at the deadline or when it
passes its memory budget, and the llguidance engine's own step limits bound its build. So a
pathological spec fails with an error and leaves no thread burning, and the other specs keep
their compile threads.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .base import Grammar, GrammarError
from .engines import DEFAULT_ENGINE, ENGINES, check_engine, make_engine
from .forms import KINDS, translate
from .json_schema import JsonSchemaOptions, normalize_schema
from .vocab import TokenVocabulary

__all__ = ["ENGINES", "GrammarBackend", "KINDS"]
log = logging.getLogger(__name__)
MAX_SPEC_CHARS = 1 << 20


class GrammarBackend:
    """`engine`: one of ENGINES. `compile_timeout`: seconds a translation may run (in a
    killable worker process; None translates on the calling thread). `max_workers`: compile
    threads, and at most as many translation processes."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int | None = None,
        eos_token_ids=None,
        *,
        json_options: JsonSchemaOptions | None = None,
        engine: str = DEFAULT_ENGINE,
        max_workers: int = 4,
        cache_size: int = 256,
        compile_timeout: float | None = None,
        max_spec_chars: int = MAX_SPEC_CHARS,
    ):
        check_engine(engine)
        self.vocab = TokenVocabulary.from_tokenizer(tokenizer, vocab_size, eos_token_ids)
        self.engine = make_engine(engine, tokenizer, self.vocab)
        self.json_options = json_options or JsonSchemaOptions()
        self.cache_size = cache_size
        self.compile_timeout = compile_timeout
        self.max_spec_chars = max_spec_chars
        self._cache: OrderedDict[tuple, Grammar | GrammarError] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="loom-grammar")
        self._inflight: dict[tuple, _Job] = {}
        self._closers: OrderedDict[tuple, Future] = OrderedDict()
        self._translators = None
        if compile_timeout is not None:
            from .translation import TranslatorPool

            self._translators = TranslatorPool(max_workers)
            # a backend dropped without shutdown() (an in-process Scheduler thrown away) must
            # not leave its forked workers behind: each holds a copy of the parent's memory
            weakref.finalize(self, self._translators.close)

    @property
    def vocab_size(self) -> int:
        return self.vocab.vocab_size

    @property
    def engine_name(self) -> str:
        return self.engine.name

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

    def closer_async(self, kind: str, spec: Any) -> Future:
        """The budget closer of (kind, spec) (closing.py), built once on the compile pool and
        cached beside the grammars; the future raises GrammarError naming
        `close_within_budget` for grammars without a regular form."""
        from .closing import Closer, closing_regex

        try:
            key = self._key(kind, spec)
        except GrammarError as e:
            out: Future = Future()
            out.set_exception(e)
            return out

        def build() -> Closer:
            schema = json.loads(key[1]) if kind == "json_schema" else spec
            return Closer(closing_regex(kind, schema, self.json_options), self.vocab)

        with self._lock:
            fut = self._closers.get(key)
            if fut is None:
                fut = self._closers[key] = self._pool.submit(build)
                while len(self._closers) > self.cache_size:
                    self._closers.popitem(last=False)
            else:
                self._closers.move_to_end(key)
        return fut

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
            hit = self._compile(kind, key[1] if kind == "json_schema" else spec)
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

    def warm_up(self) -> None:
        """Compile a small schema end to end once (what a start-up does before serving): the
        first compile otherwise pays one-time costs a request should not see -- forking the
        translation worker (with a compile timeout) and the engine's lazy set-up (llguidance's
        first matcher: ~40 ms at 128k tokens). Its one cache entry stays."""
        self.compile("json_schema", {"type": "object", "properties": {"a": {"type": "string"}}})

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._translators is not None:
            self._translators.close()

    def _key(self, kind: str, spec: Any) -> tuple:
        if kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {kind!r}; expected one of {KINDS}")
        if kind == "json_schema":
            # not sort_keys: the order of `properties` is the order the output is written in
            key = kind, json.dumps(normalize_schema(spec))
        elif kind == "choices":
            if isinstance(spec, str) or not isinstance(spec, (list, tuple)):
                raise GrammarError("choices must be a list of strings")
            key = kind, tuple(spec)
        elif not isinstance(spec, str):
            raise GrammarError(f"a {kind} grammar must be a string, got {type(spec).__name__}")
        else:
            key = kind, spec
        size = sum(map(len, key[1])) if kind == "choices" else len(key[1])
        if size > self.max_spec_chars:
            raise GrammarError(f"{kind} spec is {size} characters; the limit is "
                               f"{self.max_spec_chars}")  # fmt: skip
        return key

    def _compile(self, kind: str, spec: Any) -> Grammar:
        """Translate (in a killable worker when the backend has a timeout), then build.
        `spec` for json_schema is the normalized schema's JSON text."""
        if kind == "json_schema" and isinstance(spec, str):
            spec = json.loads(spec)
        form = self._translate(kind, spec, self.engine.json_form)
        try:
            return self.engine.build(form)
        except GrammarError:
            if kind != "json_schema" or form.syntax != "regex":
                raise
        # the engine refused the schema's regex (nested past its regex parser's depth limit,
        # with many optional members): the same schema as Lark rules
        return self.engine.build(self._translate(kind, spec, "lark"))

    def _translate(self, kind: str, spec: Any, json_form: str):
        args = (kind, spec, self.json_options, json_form, self.engine.json_regex_limit)
        if self._translators is None:
            return translate(*args)
        return self._translators.translate(args, self.compile_timeout)


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
