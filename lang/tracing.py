"""A light tracer: run a program against placeholders to see its expressions, up to the first
thing that depends on an argument or the model. `run_batch` uses the constant prefix it finds
to prefill that prefix once before the batch (SGLang's `enable_precache_with_tracing`)."""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Any

from loom.ir import (
    SglArgument,
    SglConstantText,
    SglExpr,
    SglExprList,
    SglRoleBegin,
    SglRoleEnd,
    as_expr,
)

_MAX_EXPRS = 10_000


class StopTracing(Exception):
    """The program did something the tracer cannot follow (read a value, format an argument)."""


class _Placeholder(SglArgument):
    def __str__(self) -> str:
        raise StopTracing(self.name)

    __format__ = lambda self, spec: self.__str__()  # noqa: E731 - f-strings stop the trace

    def __getattr__(self, name: str) -> Any:
        raise StopTracing(self.name)


class TracerProgramState:
    """Records expressions; `prefix` is the text before the first non-constant one."""

    def __init__(self, chat_template):
        self.chat_template = chat_template
        self.exprs: list[SglExpr] = []
        self.prefix = ""
        self._constant = True
        self._messages = 0

    def _add(self, expr: SglExpr) -> None:
        for e in expr.exprs if isinstance(expr, SglExprList) else [expr]:
            if len(self.exprs) >= _MAX_EXPRS:  # a loop the tracer cannot see the end of
                raise StopTracing("too many expressions")
            self.exprs.append(e)
            if not self._constant:
                continue
            if isinstance(e, SglConstantText):
                self.prefix += e.value
            elif isinstance(e, SglRoleBegin):
                if (
                    self._messages == 0
                    and e.role != "system"
                    and self.chat_template.default_system_prompt
                ):
                    self._constant = False  # the interpreter inserts a system turn here
                    continue
                self.prefix += self.chat_template.get_prefix_and_suffix(e.role, [])[0]
            elif isinstance(e, SglRoleEnd):
                self.prefix += self.chat_template.get_prefix_and_suffix(e.role, [])[1]
                self._messages += 1
            else:
                self._constant = False

    def __iadd__(self, other: Any) -> TracerProgramState:
        self._add(as_expr(other))
        return self

    @contextmanager
    def _role(self, name: str):
        self._add(SglRoleBegin(name))
        yield
        self._add(SglRoleEnd(name))

    def _role_common(self, name: str, expr: Any = None):
        if expr is None:
            return self._role(name)
        self._add(SglExprList([SglRoleBegin(name), as_expr(expr), SglRoleEnd(name)]))

    def system(self, expr: Any = None):
        return self._role_common("system", expr)

    def user(self, expr: Any = None):
        return self._role_common("user", expr)

    def assistant(self, expr: Any = None):
        return self._role_common("assistant", expr)

    def __getitem__(self, name: str) -> Any:
        raise StopTracing(name)

    def __getattr__(self, name: str) -> Any:  # fork, text, var_scope, ...
        raise StopTracing(name)


def trace_program(program, kwargs: dict, backend: Any = None) -> TracerProgramState:
    from loom.backends.engine import resolve_backend
    from loom.chat_template import get_chat_template

    try:
        template = resolve_backend(backend).get_chat_template()
    except ValueError:
        template = get_chat_template("default")
    state = TracerProgramState(template)
    arguments = {**program.bind_arguments, **kwargs}
    for name in program.arg_names:
        arguments.setdefault(name, _Placeholder(name))
    if inspect.iscoroutinefunction(program.func):
        return state
    try:
        program.func(state, **arguments)
    except Exception:  # noqa: BLE001 - tracing stops wherever the program leaves its reach
        pass
    return state


def cache_program(program, backend: Any) -> None:
    """Prefill the program's constant prefix once (when long enough to matter)."""
    if not getattr(backend, "supports_prefix_cache", False):
        return
    prefix = trace_program(program, {}, backend).prefix
    if len(prefix) > 64:
        backend.cache_prefix(prefix)
