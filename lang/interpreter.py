"""StreamExecutor: what a program state does with each expression (text, roles, gen, select,
variable scopes, fork and join). The queueing, threads/tasks and waiting are `QueueWorker`'s.

State contract: `variables[name]` is final once it is present and no queued expression will
set it again (`_var_pending[name] == 0`); a reader that waits for a name nothing queued can
produce gets a KeyError instead of a hang. Forks copy the state at their fork point.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

from loom.ir import (
    SglCommitLazy,
    SglConcateAndAppend,
    SglConstantText,
    SglExpr,
    SglExprList,
    SglGen,
    SglPinned,
    SglRoleBegin,
    SglRoleEnd,
    SglSamplingParams,
    SglSelect,
    SglToolGen,
    SglVarScopeBegin,
    SglVarScopeEnd,
)
from loom.worker import Handler, QueueWorker


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
    if isinstance(expr, (SglGen, SglSelect, SglVarScopeEnd, SglToolGen)):
        return [expr.name]
    if isinstance(expr, _Call) and expr.produces is not None:
        return [expr.produces]
    return []


class StreamExecutor(QueueWorker):
    def __init__(
        self,
        backend: Any,
        arguments: dict,
        default_sampling_para: SglSamplingParams,
        chat_template: Any = None,
        stream: bool = False,
        loop: asyncio.AbstractEventLoop | None = None,
    ):
        super().__init__(loop)
        self.backend = backend
        self.arguments = arguments
        self.default_sampling_para = default_sampling_para
        self.chat_template = chat_template or backend.get_chat_template()
        self.stream = stream

        # Program state (copied into forks).
        self.text_ = ""
        self.messages_: list[dict] = []
        self.variables: dict[str, Any] = {}
        self.meta_info: dict[str, Any] = {}
        self.cur_role: str | None = None
        self.cur_role_begin_pos: int | None = None
        self.fork_start_text_pos = 0
        self.var_scopes: dict[str, int] = {}
        self._forked = True  # False for a fork until its parent fills it in
        self._start()

    def produced_names(self, expr: SglExpr) -> list[str]:
        return _produced_names(expr)

    # ------------------------------------------------------------------ variables
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
        elif isinstance(expr, SglPinned):
            self._fill((yield ("call", "pinned_text", (expr.name,))))
        elif isinstance(expr, SglGen):
            yield from self._execute_gen(expr)
        elif isinstance(expr, SglToolGen):
            yield from self._execute_tool_gen(expr)
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

    def _execute_tool_gen(self, expr: SglToolGen) -> Handler:
        from loom.tools import parse_call, round_regex

        calls: list[dict] = []
        comp, meta = "", None
        for round_ in range(expr.max_rounds):
            required = expr.tool_choice == "required" and round_ == 0
            regex = round_regex(expr.tools, required)
            params = dataclasses.replace(self._resolve(expr.sampling_params), regex=regex, n=1)
            comp, meta = yield ("call", "generate", (self.text_, params, list(self.messages_)))
            comp = comp[0] if isinstance(comp, list) else comp
            self._fill(comp)
            call = parse_call(comp)
            if call is None:
                break
            tool = next(t for t in expr.tools if t.name == call[0])
            result = str(tool.fn(**call[1]))
            calls.append({"name": call[0], "arguments": call[1], "result": result})
            self._fill(f"\nObservation: {result}\n")
        info = {**(meta if isinstance(meta, dict) else {}), "tool_calls": calls}
        self._set_var(expr.name, comp, info)

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
