"""Translation in killable worker processes: a runaway spec costs its deadline, not a thread.

loom's translation (forms.translate) is Python: a pathological spec (a oneOf whose overlap check
must build an exponential automaton, say) can run for hours, and a Python thread cannot be
stopped. So the backend hands each translation to a forked worker process and waits at most
the compile timeout; a worker past its deadline is killed (SIGKILL) and replaced on the next
use. Each worker also has an address-space budget (`MEMORY_BUDGET` bytes above what it
inherited), so a translation that balloons fails with MemoryError instead of swapping the host.

Workers are forked lazily (cheap, and the child shares the parent's loaded modules); at most
`size` exist, one per concurrent translation.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing as mp
import os
import queue
import resource
import threading
import time

from .base import GrammarError
from .forms import translate

MEMORY_BUDGET = 2 << 30
log = logging.getLogger(__name__)


class TranslatorPool:
    def __init__(self, size: int):
        self.size = size
        self._idle: queue.LifoQueue[_Worker] = queue.LifoQueue()
        self._slots = threading.Semaphore(size)
        self._lock = threading.Lock()
        self._all: set[_Worker] = set()
        self._warned = False

    def translate(self, args: tuple, timeout: float):
        """forms.translate(*args) in a worker; GrammarError on failure or past `timeout` s."""
        if mp.current_process().daemon:  # multiprocessing forbids children here
            if not self._warned:
                self._warned = True
                log.warning("grammar translation runs unbounded: a daemonic process has no workers")
            return translate(*args)
        with self._slots:
            worker = self._take()
            try:
                status, value = worker.run(args, timeout)
            except BaseException:  # past its deadline, dead, or interrupted: never reused
                self._discard(worker)
                raise
            self._idle.put(worker)
        if status != "ok":
            raise GrammarError(value)
        return value

    def _take(self) -> _Worker:
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            pass
        worker = _Worker()
        with self._lock:
            self._all.add(worker)
        return worker

    def _discard(self, worker: _Worker) -> None:
        worker.kill()
        with self._lock:
            self._all.discard(worker)

    def close(self) -> None:
        with self._lock:
            workers, self._all = list(self._all), set()
        for w in workers:
            w.kill()

    def alive(self) -> int:
        """Worker processes still running (for tests and /server_info)."""
        with self._lock:
            return sum(w.proc.is_alive() for w in self._all)


class _Worker:
    def __init__(self):
        ctx = mp.get_context("fork")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child,), daemon=True, name="loom-translate")
        self.proc.start()
        child.close()

    def run(self, args: tuple, timeout: float):
        self.conn.send(args)
        deadline = time.monotonic() + timeout
        if not self.conn.poll(max(0.0, deadline - time.monotonic())):
            raise GrammarError(f"compiling took longer than {timeout:g} s (stopped)")
        try:
            return self.conn.recv()
        except EOFError:
            raise GrammarError("the grammar translation worker died (out of memory?)") from None

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()


def _serve(conn) -> None:
    """The worker's loop: translate each request, reply ("ok", Form) or ("error", message)."""
    # the scheduler's objects stay shared with it: a collection would write every tracked
    # object's header and so copy each page of them into this process (~100 MB measured)
    gc.freeze()
    _exit_with_parent()
    try:
        with open("/proc/self/statm") as f:
            inherited = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        limit = inherited + MEMORY_BUDGET
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (OSError, ValueError):  # no /proc or no permission: the deadline still applies
        pass
    while True:
        try:
            args = conn.recv()
        except EOFError:
            return
        try:
            reply = ("ok", translate(*args))
        except GrammarError as e:
            reply = ("error", str(e))
        except MemoryError:
            reply = ("error", f"{args[0]}: translation passed its memory budget")
        except RecursionError:
            reply = ("error", f"{args[0]} spec nests too deeply")
        except Exception as e:  # noqa: BLE001 - a translator bug is the spec's error
            reply = ("error", f"cannot compile {args[0]}: {type(e).__name__}: {e}")
        conn.send(reply)


def _exit_with_parent() -> None:
    """End this worker when the process that forked it dies (a SIGKILLed scheduler). The pipe
    alone cannot say so: workers forked later inherit the parent's ends of earlier workers'
    pipes, so EOF never comes, and PR_SET_PDEATHSIG fires on the forking *thread's* exit."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="loom-translate-parent").start()
