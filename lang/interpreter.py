"""StreamExecutor: runs one program state's expressions in order, off the caller's thread.

`s += expr` only enqueues; a worker (a thread, or an asyncio task in async mode) executes the
queue, so many states (forks, batches) reach the runtime together. Readers (`s["v"]`,
`s.text()`) block until what they read is final.

Each expression handler is a generator that yields backend operations; a sync driver (thread
mode) and an async driver (asyncio mode) perform them. So the semantics live in one place:

    ("call", method, args)            -> result of backend.method(*args) / await backend.amethod
    ("stream", method, args, on_item) -> on_item(x) for x in backend.method(*args)
    ("wait", executor, pred)          -> block until pred() (raising that executor's error)

State contract: `variables[name]` is final once `name in _var_pending` is false and the name
is present; an error stops the queue (later expressions are skipped) and is re-raised to every
reader and waiter, including forks of this state and the state joining them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
from collections import Counter
from collections.abc import Callable, Generator
from typing import Any

from loom.ir import (
    SglCommitLazy,
    SglConcateAndAppend,
    SglConstantText,
    SglExpr,
    SglExprList,
    SglGen,
    SglRoleBegin,
    SglRoleEnd,
    SglSamplingParams,
    SglSelect,
    SglVarScopeBegin,
    SglVarScopeEnd,
)

Op = tuple
Handler = Generator[Op, Any, None]


class _ForkStart(SglExpr):
    """A fork's first expression: wait until the parent has copied its state in."""

    def __init__(self, parent: StreamExecutor):
        self.parent = parent


class _ForkPoint(SglExpr):
    """In the parent: cache the shared prefix (n > 1), then copy the state into each fork."""

    def __init__(self, children: list[StreamExecutor]):
        self.children = children


class _GatherJoin(SglExpr):
    """Append each fork's new variables (and meta) to the parent's as lists."""

    def __init__(self, children: list[StreamExecutor]):
        self.children = children


class _Call(SglExpr):
    """Run a function on the executor's own thread, in queue order (e.g. `s["v"] = x`)."""

    def __init__(self, fn: Callable[[StreamExecutor], None], produces: str | None = None):
        self.fn = fn
        self.produces = produces


def _produced_names(expr: SglExpr) -> list[str]:
    if isinstance(expr, SglExprList):
        return [n for e in expr.exprs for n in _produced_names(e)]
    if isinstance(expr, (SglGen, SglSelect, SglVarScopeEnd)):
        return [expr.name]
    if isinstance(expr, _Call) and expr.produces is not None:
        return [expr.produces]
    return []


class StreamExecutor:
    def __init__(
        self,
        backend: Any,
        arguments: dict,
        default_sampling_para: SglSamplingParams,
        chat_template: Any = None,
        stream: bool = False,
        loop: asyncio.AbstractEventLoop | None = None,
    ):
        self.backend = backend
        self.arguments = arguments
        self.default_sampling_para = default_sampling_para
        self.chat_template = chat_template or backend.get_chat_template()
        self.stream = stream
        self.loop = loop  # set: async mode (an asyncio task instead of a thread)

        # Program state (copied into forks).
        self.text_ = ""
        self.messages_: list[dict] = []
        self.variables: dict[str, Any] = {}
        self.meta_info: dict[str, Any] = {}
        self.cur_role: str | None = None
        self.cur_role_begin_pos: int | None = None
        self.fork_start_text_pos = 0
        self.var_scopes: dict[str, int] = {}

        # Execution state.
        self.error_: BaseException | None = None
        self.is_finished = False
        self.children: list[StreamExecutor] = []
        self.parent: StreamExecutor | None = None
        self._forked = True  # False for a fork until its parent fills it in
        self._ended = False
        self._pending = 0  # submitted and not yet executed (the end marker included)
        self._var_pending: Counter = Counter()
        self._version = 0
        self._cond = threading.Condition()
        self._async_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        if loop is None:
            self._queue: Any = queue.Queue()
            threading.Thread(target=self._thread_main, daemon=True, name="loom-state").start()
        else:
            self._queue = asyncio.Queue()
            self._on_loop(lambda: self._keep(loop.create_task(self._async_main())))

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
    def submit(self, expr: SglExpr | None) -> None:
        """Enqueue an expression (None ends the state); never blocks."""
        with self._cond:
            if self._ended:
                raise RuntimeError("this program state has ended; it accepts no more expressions")
            if expr is None:
                self._ended = True
            self._pending += 1
            if expr is not None:
                self._var_pending.update(_produced_names(expr))
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
                except BaseException as e:  # noqa: BLE001 - surfaced to readers
                    self.fail(e)
            self._done_one(expr)
            if expr is None:
                return

    def _done_one(self, expr: SglExpr | None) -> None:
        with self._cond:
            self._pending -= 1
            if expr is None:
                self.is_finished = True
            else:
                self._var_pending.subtract(_produced_names(expr))
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
            loop.call_soon_threadsafe(_resolve, fut)
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

    def var_ready(self, name: str) -> Callable[[], bool]:
        """True once `name` is final, or once nothing queued can still produce it."""
        return lambda: (name in self.variables and self._var_pending[name] <= 0) or self.idle()

    def get_var(self, name: str) -> Any:
        self.wait_until(self.var_ready(name))
        return self._read_var(name)

    async def get_var_async(self, name: str) -> Any:
        await self.wait_until_async(self.var_ready(name))
        return self._read_var(name)

    def _read_var(self, name: str) -> Any:
        if name not in self.variables:
            if self.error_ is not None:
                raise self.error_
            raise KeyError(f"program variable {name!r} is not set")
        return self.variables[name]

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

    # ------------------------------------------------------------------ fork
    def fork(self, size: int) -> list[StreamExecutor]:
        children = [
            StreamExecutor(
                self.backend,
                self.arguments,
                self.default_sampling_para,
                self.chat_template,
                self.stream,
                self.loop,
            )
            for _ in range(int(size))
        ]
        for child in children:
            child._forked = False
            child.parent = self
            child.submit(_ForkStart(self))
        self.children.extend(children)
        self.submit(_ForkPoint(children))
        return children

    # ------------------------------------------------------------------ expressions
    def _execute(self, expr: SglExpr) -> Handler:
        if isinstance(expr, SglExprList):
            for e in expr.exprs:
                yield from self._execute(e)
        elif isinstance(expr, SglConstantText):
            self._fill(expr.value)
        elif isinstance(expr, SglGen):
            yield from self._execute_gen(expr)
        elif isinstance(expr, SglSelect):
            decision = yield (
                "call",
                "select",
                (self.text_, expr.choices, expr.temperature, expr.choices_method, self.messages_),
            )
            self._fill(decision.decision)
            self._set_var(expr.name, decision.decision, decision.meta_info)
        elif isinstance(expr, SglRoleBegin):
            self._role_begin(expr.role)
        elif isinstance(expr, SglRoleEnd):
            self._role_end(expr.role)
        elif isinstance(expr, SglVarScopeBegin):
            self.var_scopes[expr.name] = len(self.text_)
        elif isinstance(expr, SglVarScopeEnd):
            start = self.var_scopes.pop(expr.name, len(self.text_))
            self._set_var(expr.name, self.text_[start:], None)
        elif isinstance(expr, SglCommitLazy):
            if self.text_ and self.backend.supports_prefix_cache:
                yield ("call", "cache_prefix", (self.text_,))
        elif isinstance(expr, _ForkPoint):
            yield from self._execute_fork_point(expr)
        elif isinstance(expr, _ForkStart):
            yield ("wait", expr.parent, lambda: self._forked)
        elif isinstance(expr, _GatherJoin):
            yield from self._execute_gather(expr)
        elif isinstance(expr, SglConcateAndAppend):
            for state in expr.states:
                child = state.stream_executor
                yield ("wait", child, child.all_done)
                self._fill(child.text_[child.fork_start_text_pos :])
        elif isinstance(expr, _Call):
            expr.fn(self)
            self._notify()
        else:
            raise TypeError(f"unknown expression {expr!r}")

    def _fill(self, text: str) -> None:
        self.text_ += text
        self._notify()

    def _set_var(self, name: str | None, value: Any, meta: Any) -> None:
        self.variables[name] = value
        if meta is not None:
            self.meta_info[name] = meta
        self._notify()

    def _resolve(self, params: SglSamplingParams) -> SglSamplingParams:
        resolved = self.default_sampling_para.merged(params)
        stop_str = self.chat_template.stop_str
        if self.cur_role == "assistant" and stop_str:
            stop = resolved.stop_list()
            resolved = dataclasses.replace(
                resolved, stop=stop + [s for s in stop_str if s not in stop]
            )
        return resolved

    def _execute_gen(self, expr: SglGen) -> Handler:
        params = self._resolve(expr.sampling_params)
        args = (self.text_, params, list(self.messages_))
        if not self.stream:
            comp, meta = yield ("call", "generate", args)
            self._fill(comp[0] if isinstance(comp, list) else comp)
            self._set_var(expr.name, comp, meta)
            return
        base = self.text_
        self.variables[expr.name] = ""

        def on_item(item: tuple[Any, Any]) -> None:
            comp, meta = item
            self.text_ = base + (comp[0] if isinstance(comp, list) else comp)
            self.variables[expr.name] = comp
            self.meta_info[expr.name] = meta
            self._notify()

        yield ("stream", "generate_stream", args, on_item)

    def _role_begin(self, role: str) -> None:
        if self.cur_role is not None:
            raise ValueError(
                f"role {role!r} begins inside role {self.cur_role!r}: roles do not nest"
            )
        if not self.messages_ and role != "system":
            default_system = self.chat_template.default_system_prompt
            if default_system:
                self._role_begin("system")
                self._fill(default_system)
                self._role_end("system")
        self.cur_role = role
        prefix, _ = self.chat_template.get_prefix_and_suffix(role, self.messages_)
        self._fill(prefix)
        self.cur_role_begin_pos = len(self.text_)

    def _role_end(self, role: str) -> None:
        if self.cur_role != role:
            raise ValueError(f"role {role!r} ends but the current role is {self.cur_role!r}")
        content = self.text_[self.cur_role_begin_pos :].lstrip()
        _, suffix = self.chat_template.get_prefix_and_suffix(role, self.messages_)
        self._fill(suffix)
        self.messages_.append({"role": role, "content": content})
        self.cur_role = None

    def _execute_fork_point(self, expr: _ForkPoint) -> Handler:
        if len(expr.children) > 1 and self.text_ and self.backend.supports_prefix_cache:
            yield ("call", "cache_prefix", (self.text_,))
        for child in expr.children:
            child.text_ = self.text_
            child.messages_ = list(self.messages_)
            child.variables = dict(self.variables)
            child.meta_info = dict(self.meta_info)
            child.cur_role = self.cur_role
            child.cur_role_begin_pos = self.cur_role_begin_pos
            child.var_scopes = dict(self.var_scopes)
            child.fork_start_text_pos = len(self.text_)
            child._forked = True
        self._notify()

    def _execute_gather(self, expr: _GatherJoin) -> Handler:
        for child in expr.children:
            yield ("wait", child, child.all_done)
        known = set(self.variables)
        for child in expr.children:
            for name in child.variables.keys() - known:
                self.variables.setdefault(name, []).append(child.variables[name])
                if name in child.meta_info:
                    self.meta_info.setdefault(name, []).append(child.meta_info[name])
        self._notify()


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)
