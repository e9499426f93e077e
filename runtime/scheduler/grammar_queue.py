"""Requests whose grammar is compiling, off the scheduler thread.

A request with a regex / json_schema / ebnf constraint waits here until its compile future is
done; a compile error or a compile slower than `--grammar-compile-timeout` finishes the request
with that error (status 400) and never blocks the others: the backend translates in worker
processes it kills at that timeout (grammar/translation.py), so a runaway spec leaves nothing
running. `engine` is `--grammar-backend`. The timeout counts from when the
compile starts (a burst of distinct specs queues for the compile workers); waiting for a worker
is bounded separately (QUEUE_WAIT_FACTOR timeouts). A spec that timed out fails fast after that,
so retries cannot pile more runaway compiles onto the workers.

A request that closes within its budget (`close_within_budget`, grammar/closing.py) also waits
for the spec's closer; its grammar is then wrapped to steer onto a complete output in the
tokens left. A closer that cannot be built fails the request when the field was asked for,
and leaves the grammar unwrapped when it was only the default; a default one that takes
longer than CLOSER_WAIT (the compile timeout for a budget of SHORT_BUDGET tokens or less) lets the
request start and is attached between two steps once built
(`attach_late`).

The backend (the mask engine's view of the tokenizer: ~2 s of tables at Llama 3's 128k
vocabulary, and its resident set: Gemma 3's 262k tokens hold ~240 MB, more than loom's copy of
the weights) is built on a thread, warmed by one compile (the translation worker's fork, the
engine's lazy set-up). By default it is built when the first constrained request arrives:
that request waits here for the build (as long as the build, bounded like a queue wait),
while the others keep running, and a server that never sees a constraint never holds the
tables. `--grammar-backend-eager` builds it from `start()` at scheduler start-up instead, and
the scheduler process waits for it (`wait_ready`) before it reports ready, so the server is
healthy only once a first constrained request would pay just its own compile (as SGLang's
grammar backends build their tokenizer info at start-up).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future

from loom.runtime.req import Req

QUEUE_WAIT_FACTOR = 4
logger = logging.getLogger(__name__)
# seconds a request closing by default waits for its closer before it starts without one
CLOSER_WAIT = 2.0
# ... unless its max_new_tokens is at most this: a short budget can be spent before a late closer
# is attached (a loaded machine builds closers slowly), so such a request waits for its closer
# up to the compile timeout and starts without one only if that passes
SHORT_BUDGET = 128


class GrammarQueue:
    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_ids,
        timeout: float,
        engine: str = "llguidance",
        eager: bool = False,
    ):
        self.tokenizer = tokenizer
        self.engine = engine
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.timeout = timeout
        self._backend = None
        self._building: Future | None = None  # the start-up build, while it runs
        self.pending: list[tuple[Req, Future | None, float]] = []  # None: waits for the build
        self.closers: dict[int, Future] = {}  # id(req) -> its closer, while it compiles
        # requests that started before their (default) closer was built: (req, its closer)
        self.late: list[tuple[Req, Future]] = []
        if eager:  # --grammar-backend-eager: the tables build while the rest of start-up runs
            self.start()

    def _build(self, warm: bool = False):
        from loom.grammar.backend import GrammarBackend
        from loom.runtime.gguf.vocab import real_tokenizer

        backend = GrammarBackend(
            real_tokenizer(self.tokenizer),  # a GGUF file's: built here, on the build thread
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
            from loom.runtime.process import release_free_heap

            try:
                backend = self._build(warm=True)
            except BaseException as e:  # noqa: BLE001 - raised to the first grammar request
                fut.set_exception(e)
                return
            # the mask engine's tokenizer view is built from a JSON of the whole tokenizer and
            # frees most of what that took (Gemma 3: 129 MB kept resident by malloc otherwise;
            # docs/benchmarks.md, "Issue 32: where the scheduler's memory goes")
            release_free_heap()
            fut.set_result(backend)

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
        """Start compiling; returns an error message when it cannot even start. Before the
        backend is built, the request waits for the build (started here if it was not)
        with no compile future yet (None): `poll` starts its compile once the build is done."""
        if self.tokenizer is None:
            return f"{kind}: grammar-constrained decoding needs the tokenizer (skip_tokenizer_init is set)"
        if not self.ready:
            self.start()
            self.pending.append((req, None, time.monotonic()))
            return None
        try:
            self._compile(req, kind, spec, time.monotonic())
        except Exception as e:  # noqa: BLE001 - the build failed: each request gets its error
            return f"{kind}: the grammar backend failed to build: {e}"
        return None

    def _compile(self, req: Req, kind: str, spec, now: float) -> None:
        self.pending.append((req, self.backend.compile_async(kind, spec), now))
        if getattr(req.sampling_params, "closes_within_budget", False):
            self.closers[id(req)] = self.backend.closer_async(kind, spec)

    def _start_waiting(self, failed: list[tuple[Req, str]]) -> None:
        """Requests that waited for the backend's build: start their compiles once it is
        done (the compile timeout counts from then), fail them if it failed, or if it took
        longer than a queue wait (QUEUE_WAIT_FACTOR timeouts)."""
        now = time.monotonic()
        waiting = [(r, a) for r, fut, a in self.pending if fut is None]
        if not waiting:
            return
        error = None
        if self.ready:
            try:
                self.backend  # noqa: B018 - takes the build's result (or its error)
            except Exception as e:  # noqa: BLE001 - the build's failure is each request's error
                error = f"the grammar backend failed to build: {e}"
        late = (
            f"building the grammar backend took longer than {QUEUE_WAIT_FACTOR * self.timeout:g} s"
        )
        self.pending = [p for p in self.pending if p[1] is not None]
        for req, admitted in waiting:
            kind, spec = req.sampling_params.grammar_spec or ("grammar", None)
            if error is not None:
                failed.append((req, f"{kind}: {error}"))
            elif self.ready:
                self._compile(req, kind, spec, now)
            elif now - admitted > QUEUE_WAIT_FACTOR * self.timeout:
                failed.append((req, f"{kind}: {late}"))
            else:
                self.pending.append((req, None, admitted))

    def poll(self) -> tuple[list[Req], list[tuple[Req, str]]]:
        """(requests now ready, (request, error) pairs); both leave the queue."""
        ready, failed, still = [], [], []
        self._start_waiting(failed)
        now = time.monotonic()
        for req, fut, admitted in self.pending:
            if fut is None:  # still waiting for the backend's build
                still.append((req, fut, admitted))
                continue
            kind, spec = req.sampling_params.grammar_spec or ("grammar", None)
            started = fut.compile_started()
            closer = self.closers.get(id(req))
            if fut.done() and (closer is None or closer.done() or fut.exception() is not None):
                self.closers.pop(id(req), None)
                try:
                    req.grammar = fut.result()
                except Exception as e:  # noqa: BLE001 - any compile failure is the request's error
                    failed.append((req, f"{kind}: {e}"))
                    continue
                error = _close(req, closer)
                if error is None:
                    ready.append(req)
                else:
                    failed.append((req, error))
            elif (
                fut.done()
                and req.sampling_params.close_within_budget is not True
                and now - admitted > _closer_wait(req, self.timeout)
            ):  # closing by default: start without the closer, attach it when it is built
                self.closers.pop(id(req), None)
                req.grammar = fut.result()
                self.late.append((req, closer))
                ready.append(req)
            elif fut.done() and now - admitted > self.timeout:  # asked for, and late
                self.closers.pop(id(req), None)
                failed.append((req, f"close_within_budget: building the closer took longer "
                               f"than {self.timeout:g} s"))  # fmt: skip
            elif started is not None and now - started > self.timeout:
                msg = f"compiling took longer than {self.timeout:g} s"
                self.closers.pop(id(req), None)
                self.backend.give_up(kind, spec, msg)
                failed.append((req, f"{kind}: {msg}"))
            elif started is None and now - admitted > QUEUE_WAIT_FACTOR * self.timeout:
                self.closers.pop(id(req), None)
                failed.append((req, f"{kind}: every grammar compile worker stayed busy for "
                               f"{QUEUE_WAIT_FACTOR * self.timeout:g} s"))  # fmt: skip
            else:
                still.append((req, fut, admitted))
        self.pending = still
        return ready, failed

    def attach_late(self) -> None:
        """Wrap the grammars of running requests whose closer is now built (between steps:
        the wrapper replays the output so far through the closer)."""
        if not self.late:
            return
        still = []
        for req, closer in self.late:
            if req.finished or req.grammar is None:
                continue
            if not closer.done():
                still.append((req, closer))
            elif closer.exception() is None:
                from loom.grammar.closing import ClosingGrammar

                req.grammar = ClosingGrammar.attach(
                    req.grammar, closer.result(), req.sampling_params.max_new_tokens,
                    req.output_ids,
                )  # fmt: skip
        self.late = still

    def remove(self, rid: str) -> list[Req]:
        gone = [r for r, _, _ in self.pending if rid in ("", r.rid)]
        for r in gone:
            self.closers.pop(id(r), None)
        self.late = [(r, c) for r, c in self.late if rid not in ("", r.rid)]
        self.pending = [p for p in self.pending if p[0] not in gone]
        return gone


def _close(req: Req, closer: Future | None) -> str | None:
    """Wrap `req.grammar` with its closer; the error message when the request asked for
    closing and the spec has no closer."""
    if closer is None:
        return None
    try:
        built = closer.result()
    except Exception as e:  # noqa: BLE001 - a GrammarError naming the field, or a build failure
        if req.sampling_params.close_within_budget is True:
            msg = str(e)
            return msg if msg.startswith("close_within_budget") else f"close_within_budget: {msg}"
        return None
    from loom.grammar.closing import ClosingGrammar

    budget = req.sampling_params.max_new_tokens - len(req.output_ids)
    req.grammar = ClosingGrammar(req.grammar, built, budget)
    return None


def _closer_wait(req: Req, timeout: float) -> float:
    """Seconds a request closing by default waits for its closer before it starts without it."""
    budget = req.sampling_params.max_new_tokens
    return timeout if budget is not None and budget <= SHORT_BUDGET else CLOSER_WAIT
