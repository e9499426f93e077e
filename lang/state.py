"""ProgramState: what a program's `s` is. `s += expr` enqueues; reads wait for the value."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from loom.interpreter import StreamExecutor, _Call
from loom.ir import (
    SglExprList,
    SglRoleBegin,
    SglRoleEnd,
    SglVarScopeBegin,
    SglVarScopeEnd,
    as_expr,
)

if TYPE_CHECKING:
    from loom.fork import ProgramStateGroup


class ProgramState:
    def __init__(self, stream_executor: StreamExecutor):
        self.stream_executor = stream_executor
        self.ret_value: Any = None

    # ------------------------------------------------------------------ appending
    def __iadd__(self, other: Any) -> ProgramState:
        self.stream_executor.submit(as_expr(other))
        return self

    def _role_common(self, name: str, expr: Any = None):
        if expr is not None:
            role_expr = SglExprList([SglRoleBegin(name), as_expr(expr), SglRoleEnd(name)])
            self.stream_executor.submit(role_expr)
            return role_expr

        @contextmanager
        def role_scope():
            self.stream_executor.submit(SglRoleBegin(name))
            yield
            self.stream_executor.submit(SglRoleEnd(name))

        return role_scope()

    def system(self, expr: Any = None):
        return self._role_common("system", expr)

    def user(self, expr: Any = None):
        return self._role_common("user", expr)

    def assistant(self, expr: Any = None):
        return self._role_common("assistant", expr)

    @contextmanager
    def var_scope(self, name: str):
        self.stream_executor.submit(SglVarScopeBegin(name))
        yield
        self.stream_executor.submit(SglVarScopeEnd(name))

    def fork(self, size: int = 1, position_ids_offset: Any = None) -> ProgramStateGroup:
        from loom.fork import ProgramStateGroup

        children = self.stream_executor.fork(size)
        return ProgramStateGroup([ProgramState(c) for c in children], self)

    # ------------------------------------------------------------------ reading
    def _guard_loop(self) -> None:
        """A blocking read on the loop that runs this state would deadlock it."""
        ex = self.stream_executor
        if ex.loop is None:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            return
        if running is ex.loop and not ex.idle():
            raise RuntimeError(
                "this async program state is still running; use `await s.aget(name)` / "
                "`await s.atext()` inside async programs"
            )

    def get_var(self, name: str) -> Any:
        self._guard_loop()
        return self.stream_executor.get_var(name)

    def set_var(self, name: str, value: Any) -> None:
        def assign(ex: StreamExecutor) -> None:
            ex.variables[name] = value

        self.stream_executor.submit(_Call(assign, produces=name))

    def __getitem__(self, name: str) -> Any:
        return self.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.set_var(name, value)

    def __contains__(self, name: str) -> bool:
        self.sync()
        return name in self.stream_executor.variables

    def get_meta_info(self, name: str) -> Any:
        self.get_var(name)
        return self.stream_executor.meta_info.get(name)

    def sync(self) -> None:
        self._guard_loop()
        self.stream_executor.sync()

    def text(self) -> str:
        self.sync()
        return self.stream_executor.text_

    def messages(self) -> list[dict]:
        self.sync()
        return list(self.stream_executor.messages_)

    def error(self) -> BaseException | None:
        return self.stream_executor.error_

    async def aget(self, name: str) -> Any:
        return await self.stream_executor.get_var_async(name)

    async def atext(self) -> str:
        ex = self.stream_executor
        await ex.wait_until_async(ex.idle)
        if ex.error_ is not None:
            raise ex.error_
        return ex.text_

    async def amessages(self) -> list[dict]:
        await self.atext()
        return list(self.stream_executor.messages_)

    # ------------------------------------------------------------------ streaming
    def _chunk_source(self, var_name: str | None):
        """(current text, is it final) of the whole text or one variable."""
        ex = self.stream_executor

        def current() -> tuple[str, bool]:
            if var_name is None:
                return ex.text_, ex.is_finished
            value = ex.variables.get(var_name, "")
            if isinstance(value, list):
                value = value[0] if value else ""
            done = (var_name in ex.variables and ex._var_pending[var_name] <= 0) or ex.is_finished
            return str(value), done

        return current

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """Chunks of the text (or of one variable) as they are generated."""
        ex = self.stream_executor
        if not ex.stream:
            yield self.text() if var_name is None else self.get_var(var_name)
            return
        current = self._chunk_source(var_name)
        prev, seen = 0, -1
        while True:
            with ex._cond:
                while ex._version == seen and ex.error_ is None:
                    ex._cond.wait()
                seen = ex._version
            if ex.error_ is not None:
                raise ex.error_
            text, done = current()
            if len(text) > prev:
                yield text[prev:]
                prev = len(text)
            if done:
                return

    async def text_async_iter(
        self, var_name: str | None = None, return_meta_data: bool = False
    ) -> AsyncIterator[Any]:
        ex = self.stream_executor
        if not ex.stream:
            if var_name is None:
                yield await self.atext()
            else:
                value = await self.aget(var_name)
                yield (value, ex.meta_info.get(var_name)) if return_meta_data else value
            return
        current = self._chunk_source(var_name)
        prev, seen = 0, -1
        while True:
            await ex.wait_until_async(lambda s=seen: ex._version != s)
            seen = ex._version
            text, done = current()
            if len(text) > prev:
                chunk = text[prev:]
                prev = len(text)
                yield (chunk, ex.meta_info.get(var_name)) if return_meta_data else chunk
            if done:
                return

    def __repr__(self) -> str:
        return f"ProgramState({self.text()})"
