"""Requests whose grammar is compiling, off the scheduler thread.

A request with a regex / json_schema / ebnf constraint waits here until its compile future is
done; a compile error or a compile slower than `--grammar-compile-timeout` finishes the request
with that error (status 400) and never blocks the others: the backend translates in worker
processes it kills at that timeout (grammar/translation.py), so a runaway spec leaves nothing
running. `engine` is `--grammar-backend`. The timeout counts from when the
compile starts (a burst of distinct specs queues for the compile workers); waiting for a worker
is bounded separately (QUEUE_WAIT_FACTOR timeouts). A spec that timed out fails fast after that,
so retries cannot pile more runaway compiles onto the workers.

The backend (the mask engine's view of the tokenizer: ~2 s of tables at Llama 3's 128k
vocabulary) is built on a thread from `start()`, at scheduler start-up, and warmed by one
compile (the translation worker's fork, the engine's lazy set-up); the scheduler process waits
for it (`wait_ready`) before it reports ready, so the server is healthy only once a first
constrained request would pay just its own compile (as SGLang's grammar backends build their
tokenizer info at start-up).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future

from loom.runtime.req import Req

QUEUE_WAIT_FACTOR = 4
logger = logging.getLogger(__name__)


class GrammarQueue:
    def __init__(
        self, tokenizer, vocab_size: int, eos_token_ids, timeout: float, engine: str = "llguidance"
    ):
        self.tokenizer = tokenizer
        self.engine = engine
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.timeout = timeout
        self._backend = None
        self._building: Future | None = None  # the start-up build, while it runs
        self.pending: list[tuple[Req, Future, float]] = []

    def _build(self, warm: bool = False):
        from loom.grammar.backend import GrammarBackend

        backend = GrammarBackend(
            self.tokenizer,
            self.vocab_size,
            set(self.eos_token_ids),
            engine=self.engine,
            compile_timeout=self.timeout,
        )
        if warm:  # one compile end to end: the translation worker and the engine's set-up
            backend.warm_up()
        return backend

    def start(self) -> None:
        """Build the backend on a thread now (no-op without a tokenizer: no grammar then)."""
        if self.tokenizer is None or self._building is not None or self._backend is not None:
            return
        fut: Future = Future()

        def build() -> None:
            try:
                fut.set_result(self._build(warm=True))
            except BaseException as e:  # noqa: BLE001 - raised to the first grammar request
                fut.set_exception(e)

        self._building = fut
        threading.Thread(target=build, name="loom-grammar-start", daemon=True).start()

    def wait_ready(self) -> None:
        """Block until the start-up build is done. A failure is logged, not raised: only
        constrained requests need the backend, and they get the error."""
        if self._building is not None:
            try:
                self._building.result()
            except Exception:  # noqa: BLE001 - logged; each grammar request reports it
                logger.exception("the grammar backend failed to build at start-up")

    @property
    def ready(self) -> bool:
        """Whether a grammar request would find the backend built."""
        return self._backend is not None or (self._building is not None and self._building.done())

    @property
    def backend(self):
        if self._backend is None:
            self._backend = self._building.result() if self._building else self._build()
        return self._backend

    def __len__(self) -> int:
        return len(self.pending)

    def close(self) -> None:
        """Stop the backend's compile threads and translation worker processes."""
        if self._backend is None and self._building is not None and self._building.done():
            self._backend = None if self._building.exception() else self._building.result()
        if self._backend is not None:
            self._backend.shutdown()

    def add(self, req: Req, kind: str, spec: str) -> str | None:
        """Start compiling; returns an error message when it cannot even start."""
        if self.tokenizer is None:
            return f"{kind}: grammar-constrained decoding needs the tokenizer (skip_tokenizer_init is set)"
        self.pending.append((req, self.backend.compile_async(kind, spec), time.monotonic()))
        return None

    def poll(self) -> tuple[list[Req], list[tuple[Req, str]]]:
        """(requests now ready, (request, error) pairs); both leave the queue."""
        ready, failed, still = [], [], []
        now = time.monotonic()
        for req, fut, admitted in self.pending:
            kind, spec = req.sampling_params.grammar_spec or ("grammar", None)
            started = fut.compile_started()
            if fut.done():
                try:
                    req.grammar = fut.result()
                    ready.append(req)
                except Exception as e:  # noqa: BLE001 - any compile failure is the request's error
                    failed.append((req, f"{kind}: {e}"))
            elif started is not None and now - started > self.timeout:
                msg = f"compiling took longer than {self.timeout:g} s"
                self.backend.give_up(kind, spec, msg)
                failed.append((req, f"{kind}: {msg}"))
            elif started is None and now - admitted > QUEUE_WAIT_FACTOR * self.timeout:
                failed.append((req, f"{kind}: every grammar compile worker stayed busy for "
                               f"{QUEUE_WAIT_FACTOR * self.timeout:g} s"))  # fmt: skip
            else:
                still.append((req, fut, admitted))
        self.pending = still
        return ready, failed

    def remove(self, rid: str) -> list[Req]:
        gone = [r for r, _, _ in self.pending if rid in ("", r.rid)]
        self.pending = [p for p in self.pending if p[0] not in gone]
        return gone
