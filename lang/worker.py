"""QueueWorker: the mechanics under a program state. Expressions queue up and one worker
(a thread, or an asyncio task on a given loop) executes them in order; readers wait on a
condition that every change notifies (thread waiters) and on futures (asyncio waiters).

Each expression handler is a generator that yields operations; the sync driver (thread mode)
and the async driver (asyncio mode) perform them, so the semantics are written once:

    ("call", method, args)            -> backend.method(*args) / await backend.amethod(*args)
    ("stream", method, args, on_item) -> on_item(x) for x in backend.method(*args)
    ("wait", worker, pred)            -> block until pred() (raising that worker's error)

An error stops the queue (later expressions are skipped but still counted off) and is raised
to every reader and waiter. `_notify` climbs to the parent, so a wait on a whole fork tree
(join, the end of `run`) wakes when any part of it changes.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections import Counter
from collections.abc import Callable, Generator
from typing import Any

Op = tuple
Handler = Generator[Op, Any, None]


class QueueWorker:
    backend: Any

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None):
        self.loop = loop  # set: async mode (an asyncio task instead of a thread)
        self.error_: BaseException | None = None
        self.is_finished = False
        self.children: list[QueueWorker] = []
        self.parent: QueueWorker | None = None
        self._ended = False
        self._pending = 0  # submitted and not yet executed (the end marker included)
        self._var_pending: Counter = Counter()  # queued expressions that will set each name
        self._version = 0
        self._cond = threading.Condition()
        self._async_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    def _start(self) -> None:
        if self.loop is None:
            self._queue: Any = queue.Queue()
            threading.Thread(target=self._thread_main, daemon=True, name="loom-state").start()
        else:
            self._queue = asyncio.Queue()
            loop = self.loop
            self._on_loop(lambda: self._keep(loop.create_task(self._async_main())))

    # Subclass hooks.
    def _execute(self, expr: Any) -> Handler:
        raise NotImplementedError

    def produced_names(self, expr: Any) -> list[str]:
        return []

    def _keep(self, task: asyncio.Task) -> None:
        self._task = task  # a strong reference, so the task is not collected mid-run

    def _on_loop(self, fn: Callable[[], None]) -> None:
        try:
            same = asyncio.get_running_loop() is self.loop
        except RuntimeError:
            same = False
        if same:
            fn()
        else:
            self.loop.call_soon_threadsafe(fn)

    # ------------------------------------------------------------------ queue
    def submit(self, expr: Any) -> None:
        """Enqueue an expression (None ends the state); never blocks."""
        with self._cond:
            if self._ended:
                raise RuntimeError("this program state has ended; it accepts no more expressions")
            if expr is None:
                self._ended = True
            self._pending += 1
            if expr is not None:
                self._var_pending.update(self.produced_names(expr))
        if self.loop is None:
            self._queue.put(expr)
        else:
            self._on_loop(lambda: self._queue.put_nowait(expr))

    def end(self) -> None:
        """No more expressions; the worker stops after the queue drains. Ends forks too."""
        with self._cond:
            ended = self._ended
        if not ended:
            self.submit(None)
        for child in self.children:
            child.end()

    def _thread_main(self) -> None:
        while True:
            expr = self._queue.get()
            if expr is not None and self.error_ is None:
                try:
                    self._drive_sync(self._execute(expr))
                except BaseException as e:  # noqa: BLE001 - surfaced to readers
                    self.fail(e)
            self._done_one(expr)
            if expr is None:
                return

    async def _async_main(self) -> None:
        while True:
            expr = await self._queue.get()
            if expr is not None and self.error_ is None:
                try:
                    await self._drive_async(self._execute(expr))
                except asyncio.CancelledError as e:  # the loop is going away: stop here
                    self.fail(e)
                    with self._cond:
                        self.is_finished = True
                    self._notify()
                    raise
                except BaseException as e:  # noqa: BLE001 - surfaced to readers
                    self.fail(e)
            self._done_one(expr)
            if expr is None:
                return

    def _done_one(self, expr: Any) -> None:
        with self._cond:
            self._pending -= 1
            if expr is None:
                self.is_finished = True
            else:
                self._var_pending.subtract(self.produced_names(expr))
        self._notify()

    def fail(self, error: BaseException) -> None:
        if self.error_ is None:
            self.error_ = error
        self._notify()

    # ------------------------------------------------------------------ drivers
    def _drive_sync(self, handler: Handler) -> None:
        value = None
        while True:
            try:
                op = handler.send(value)
            except StopIteration:
                return
            kind = op[0]
            if kind == "call":
                value = getattr(self.backend, op[1])(*op[2])
            elif kind == "stream":
                for item in getattr(self.backend, op[1])(*op[2]):
                    op[3](item)
                value = None
            else:  # wait
                op[1].wait_until(op[2])
                value = None

    async def _drive_async(self, handler: Handler) -> None:
        value = None
        while True:
            try:
                op = handler.send(value)
            except StopIteration:
                return
            kind = op[0]
            if kind == "call":
                value = await getattr(self.backend, "a" + op[1])(*op[2])
            elif kind == "stream":
                async for item in getattr(self.backend, "a" + op[1])(*op[2]):
                    op[3](item)
                value = None
            else:
                await op[1].wait_until_async(op[2])
                value = None

    # ------------------------------------------------------------------ waiting
    def _notify(self) -> None:
        with self._cond:
            self._version += 1
            self._cond.notify_all()
            waiters, self._async_waiters = self._async_waiters, []
        for loop, fut in waiters:
            loop.call_soon_threadsafe(_resolve_future, fut)
        if self.parent is not None:  # waits on a whole tree (join, run) watch the root
            self.parent._notify()

    def _check(self, pred: Callable[[], bool]) -> bool:
        if pred():
            return True
        if self.error_ is not None:
            raise self.error_
        return False

    def wait_until(self, pred: Callable[[], bool]) -> None:
        with self._cond:
            while not self._check(pred):
                self._cond.wait()

    async def wait_until_async(self, pred: Callable[[], bool]) -> None:
        loop = asyncio.get_running_loop()
        while True:
            with self._cond:
                if self._check(pred):
                    return
                fut = loop.create_future()
                self._async_waiters.append((loop, fut))
            await fut

    def idle(self) -> bool:
        return self._pending == 0

    def all_done(self) -> bool:
        return self.is_finished and all(c.all_done() for c in self.children)

    def sync(self) -> None:
        """Wait until everything submitted so far has run; raise the state's error."""
        self.wait_until(self.idle)
        if self.error_ is not None:
            raise self.error_

    def wait_finished(self) -> None:
        self.wait_until(self.all_done)
        self._raise_tree()

    async def wait_finished_async(self) -> None:
        await self.wait_until_async(self.all_done)
        self._raise_tree()

    def _raise_tree(self) -> None:
        if self.error_ is not None:
            raise self.error_
        for child in self.children:
            child._raise_tree()


def _resolve_future(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)
