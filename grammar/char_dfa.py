"""The character-level DFA behind a regex grammar's jump-forward, built off the scheduler thread.

interegular is pure Python: its DFA for a JSON-schema regex takes from milliseconds to minutes
and gigabytes (an unanchored `pattern` such as "material" next to a free-form object ran for
90 s), and while it runs it holds the GIL the scheduler needs. So builds run one at a time on a
single daemon thread (many distinct schemas must not mean many threads fighting the scheduler),
each within a CPU-time budget (past it, that grammar simply has no jump-forward), and a grammar
that nobody holds any more is skipped.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
import weakref

NO_JUMP = object()  # the char DFA could not be built: jump-forward is off
MAX_JUMP_PATTERN = 50_000  # longer regexes are not even tried
BUILD_BUDGET_S = 10.0  # CPU seconds one build may take


class _OverBudget(Exception):
    pass


def build_char_dfa(pattern: str, budget_s: float = BUILD_BUDGET_S):
    """(fsm, live states, symbol -> chars), or NO_JUMP if it fails or runs past `budget_s`."""
    if len(pattern) > MAX_JUMP_PATTERN:
        return NO_JUMP
    try:
        import interegular

        with _cpu_budget(budget_s):
            fsm = interegular.parse_pattern(pattern).to_fsm()
    except Exception:  # noqa: BLE001 - over budget, or a construct interegular rejects
        return NO_JUMP
    # live = states from which a final state is reachable
    live = set(fsm.finals)
    changed = True
    while changed:
        changed = False
        for s, trans in fsm.map.items():
            if s not in live and any(t in live for t in trans.values()):
                live.add(s)
                changed = True
    by_symbol: dict[int, list] = {}
    for char, sym in fsm.alphabet.items():
        by_symbol.setdefault(sym, []).append(char)
    return fsm, live, by_symbol


class _cpu_budget:
    """Raise _OverBudget inside the running thread's Python calls once it has used `seconds`
    of CPU (a trace hook on call events; any tracer already set, e.g. coverage, is chained)."""

    def __init__(self, seconds: float):
        self.deadline = time.thread_time() + seconds
        self.calls = 0

    def _trace(self, frame, event, arg):
        self.calls += 1
        if self.calls % 512 == 0 and time.thread_time() > self.deadline:
            raise _OverBudget
        return self.prev(frame, event, arg) if self.prev is not None else None

    def __enter__(self):
        self.prev = sys.gettrace()
        sys.settrace(self._trace)

    def __exit__(self, *exc):
        sys.settrace(self.prev)
        return False


_queue: queue.SimpleQueue = queue.SimpleQueue()
_worker: threading.Thread | None = None
_worker_lock = threading.Lock()


def enqueue(owner) -> None:
    """Have the builder thread call `owner.build_char_dfa_if_queued()` (if `owner` still lives)."""
    global _worker
    _queue.put(weakref.ref(owner))
    with _worker_lock:
        if _worker is None or not _worker.is_alive():
            _worker = threading.Thread(target=_work, name="loom-char-dfa", daemon=True)
            _worker.start()


def _work() -> None:
    while True:
        owner = _queue.get()()
        if owner is not None:
            owner.build_char_dfa_if_queued()
        del owner
