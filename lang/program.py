"""SglFunction: what `@function` makes. `run`, `run_batch`, `run_async`, `bind`, `trace`."""

from __future__ import annotations

import asyncio
import inspect
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from loom.global_config import global_config
from loom.interpreter import StreamExecutor
from loom.ir import RUN_FIELDS, SglSamplingParams
from loom.state import ProgramState


class SglFunction:
    def __init__(self, func, num_api_spec_tokens: int | None = None, bind_arguments=None):
        self.func = func
        self.num_api_spec_tokens = num_api_spec_tokens
        self.bind_arguments = dict(bind_arguments or {})
        params = list(inspect.signature(func).parameters)
        if not params:
            raise TypeError(f"@function {func.__name__}: the first argument must be the state `s`")
        self.arg_names = params[1:]
        self.__name__ = getattr(func, "__name__", "program")
        self.__doc__ = func.__doc__

    def bind(self, **kwargs: Any) -> SglFunction:
        unknown = set(kwargs) - set(self.arg_names)
        if unknown and not _takes_var_kwargs(self.func):
            raise TypeError(f"bind: {self.__name__} has no argument(s) {sorted(unknown)}")
        return SglFunction(self.func, self.num_api_spec_tokens, {**self.bind_arguments, **kwargs})

    # ------------------------------------------------------------------ run
    def run(
        self, *args, stream: bool = False, backend=None, use_thread: bool = True, **kwargs
    ) -> ProgramState:
        """Run the program; returns its finished state (with `stream=True`, at once).
        `kwargs`: the program's arguments, and the sampling defaults every gen inherits
        (SGLang's run parameters, loom.ir.RUN_FIELDS: max_new_tokens, n, stop, temperature,
        ...)."""
        defaults = SglSamplingParams.run_defaults("run", kwargs)
        if inspect.iscoroutinefunction(self.func):
            return asyncio.run(self._run_async(args, kwargs, defaults, stream, backend))
        return self._run(args, kwargs, defaults, stream, backend)

    def _run(self, args, kwargs, defaults, stream, backend) -> ProgramState:
        backend = resolve_backend(backend)
        kwargs = {**self.bind_arguments, **kwargs}
        executor = StreamExecutor(backend, kwargs, defaults, stream=stream)
        state = ProgramState(executor)
        if stream:
            threading.Thread(
                target=self._body, args=(state, args, kwargs, False), daemon=True
            ).start()
            return state
        self._body(state, args, kwargs, True)
        return state

    def _body(self, state: ProgramState, args, kwargs, raise_errors: bool) -> None:
        executor = state.stream_executor
        try:
            state.ret_value = self.func(state, *args, **kwargs)
        except BaseException as e:
            executor.fail(e)  # stream readers see it too
            executor.end()
            if raise_errors:
                raise
            return
        executor.end()
        if raise_errors:
            executor.wait_finished()
        if global_config.verbosity >= 2:
            print(executor.text_)

    # ------------------------------------------------------------------ batch
    def run_batch(
        self,
        batch_kwargs: list[dict],
        *,
        backend=None,
        num_threads: str | int = "auto",
        progress_bar: bool = False,
        generator_style: bool = False,
        **sampling: Any,
    ):
        """Run the program once per kwargs dict, concurrently; states come back in input order
        (a generator of them with `generator_style=True`). `sampling`: as for `run`."""
        if not isinstance(batch_kwargs, (list, tuple)) or not all(
            isinstance(k, dict) for k in batch_kwargs
        ):
            raise TypeError("run_batch: batch_kwargs must be a list of dicts")
        unknown = sorted(set(sampling) - set(RUN_FIELDS))
        if unknown:
            raise TypeError(f"run_batch() got an unexpected keyword argument {unknown[0]!r}")
        backend = resolve_backend(backend)
        if not batch_kwargs:
            return iter([]) if generator_style else []
        if global_config.enable_precache_with_tracing and len(batch_kwargs) > 1:
            from loom.tracing import cache_program

            cache_program(self, backend)
        if num_threads == "auto":
            num_threads = max(96, (os.cpu_count() or 1) * 16)
        num_threads = max(1, min(int(num_threads), len(batch_kwargs)))
        results = self._batch(batch_kwargs, sampling, backend, num_threads, progress_bar)
        return results if generator_style else list(results)

    def _batch(self, batch_kwargs, sampling, backend, num_threads, progress_bar):
        bar = None
        if progress_bar:
            import tqdm

            bar = tqdm.tqdm(total=len(batch_kwargs))
        try:
            with ThreadPoolExecutor(num_threads) as pool:
                futures = []
                for kwargs in batch_kwargs:
                    fut = pool.submit(self.run, **sampling, backend=backend, **kwargs)
                    if bar is not None:
                        fut.add_done_callback(lambda _: bar.update())
                    futures.append(fut)
                for fut in futures:
                    yield fut.result()
        finally:
            if bar is not None:
                bar.close()

    # ------------------------------------------------------------------ asyncio
    async def run_async(self, *args, stream: bool = False, backend=None, **kwargs) -> ProgramState:
        """`await f.run_async(...)`: the program's states run as asyncio tasks on the calling
        loop (no thread per state). The program may be `async def` and `await s.aget(name)`;
        with `stream=True` the state returns at once for `async for ... in text_async_iter()`.
        `kwargs`: as for `run`."""
        defaults = SglSamplingParams.run_defaults("run_async", kwargs)
        return await self._run_async(args, kwargs, defaults, stream, backend)

    async def _run_async(self, args, kwargs, defaults, stream, backend) -> ProgramState:
        backend = resolve_backend(backend)
        kwargs = {**self.bind_arguments, **kwargs}
        loop = asyncio.get_running_loop()
        executor = StreamExecutor(backend, kwargs, defaults, stream=stream, loop=loop)
        state = ProgramState(executor)

        async def body() -> ProgramState:
            try:
                ret = self.func(state, *args, **kwargs)
                if inspect.isawaitable(ret):
                    ret = await ret
                state.ret_value = ret
            except BaseException as e:
                executor.fail(e)
                executor.end()
                raise
            executor.end()
            await executor.wait_finished_async()
            return state

        if stream:
            task = loop.create_task(body())
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # consumed
            state._task = task
            return state
        return await body()

    # ------------------------------------------------------------------ tracing
    def trace(self, *, backend=None, **kwargs):
        from loom.tracing import trace_program

        return trace_program(self, kwargs, backend)

    def __call__(self, *args, **kwargs):
        if args and isinstance(args[0], ProgramState):  # called as a sub-program
            return self.func(*args, **kwargs)
        return self.run(*args, **kwargs)


def _takes_var_kwargs(func) -> bool:
    return any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(func).parameters.values()
    )


def resolve_backend(backend: Any):
    from loom.backends.engine import resolve_backend

    return resolve_backend(backend)
