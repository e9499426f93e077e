"""Engine: the runtime without HTTP. It starts the scheduler and detokenizer processes and
owns a TokenizerManager running on a private event-loop thread."""

from __future__ import annotations

import asyncio
import atexit
import logging
import queue
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

from loom.runtime.io_struct import GENERATE_FIELDS, GenerateReqInput, decode_generate_request
from loom.runtime.process import yield_to_scheduler
from loom.runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)


class Engine:
    """`Engine(model_path=None, **server_args)`; None means the bundled model."""

    def __init__(self, model_path: str | None = None, **kwargs: Any):
        from loom.runtime.model_config import check_model_folder, load_config
        from loom.runtime.process import check_main_guard

        check_main_guard("loom.Engine()")
        self.server_args = ServerArgs.from_kwargs(model_path=model_path, **kwargs)
        if self.server_args.node_rank > 0:
            raise ValueError("node_rank: an Engine serves from node 0; run the other nodes "
                             "with `python -m loom.launch_server --node-rank N`")  # fmt: skip
        sa = self.server_args
        if sa.distributed_executor_backend == "ray" and sa.world_size == 1:
            raise ValueError("distributed_executor_backend: ray places an Engine's ranks "
                             "(tp/pp/ep size > 1); its dp replicas run on this node "
                             "(`loom serve --dp-size N` places replicas with Ray)")  # fmt: skip
        check_model_folder(self.server_args.model_path)  # a bad path fails here, clearly
        if self.server_args.world_size > 1:  # and so does an impossible split
            from loom.runtime.distributed import check_layout  # imports torch: not for 1 rank

            check_layout(self.server_args, load_config(self.server_args.model_path))
        self._procs: list = []
        self._closed = False
        try:
            self._launch()
        except BaseException:
            self.shutdown()
            raise
        atexit.register(self.shutdown)

    def _launch(self) -> None:
        from loom.runtime.data_parallel import DataParallelFront

        args = self.server_args
        self._ipcs: list = []
        if args.dp_size == 1:
            self.tokenizer_manager = self._replica(args)
        else:  # N replicas, CPU threads split between them (as `loom serve --dp-size N`)
            threads = max(1, args.effective_cpu_threads // args.dp_size)
            one = args.replace(dp_size=1, load_balance_method="round_robin", cpu_threads=threads)
            tms = [self._replica(one) for _ in range(args.dp_size)]
            self.tokenizer_manager = DataParallelFront(tms, args.load_balance_method)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="loom-engine", daemon=True)
        self._thread.start()
        self._call(self.tokenizer_manager.start())

    def _replica(self, args: ServerArgs):
        """Start one replica's processes; its TokenizerManager (not yet started)."""
        from loom.runtime.process import IPCNames
        from loom.runtime.server.launch import start_runtime_processes
        from loom.runtime.tokenizer_manager import TokenizerManager

        ipc = IPCNames.fresh()
        self._ipcs.append(ipc)
        self.ipc = self._ipcs[0]  # the first replica's endpoints
        procs: list = []
        try:
            info, tokenizer = start_runtime_processes(args, ipc, procs)
        finally:
            self._procs += procs
        self.scheduler_info = info
        self.tokenizer = tokenizer
        tm = TokenizerManager(args, ipc, tokenizer, info["context_length"], info["vocab_size"])
        tm.watched_processes = procs
        return tm
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="loom-engine", daemon=True)
        self._thread.start()
        self._call(self.tokenizer_manager.start())

    def _run_loop(self) -> None:
        # this loop wakes per streamed token: it must not preempt the forward
        yield_to_scheduler(self.server_args)
        self._loop.run_forever()

    def _call(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        *,
        stream: bool = False,
        **fields: Any,
    ) -> dict | list[dict] | Iterator[dict]:
        """SGLang's Engine.generate. `fields` are the other GenerateReqInput fields (rid,
        return_logprob, logprob_start_len, top_logprobs_num, return_text_in_logprobs, ...),
        checked by the same decoder as an HTTP body."""
        obj = _request(prompt, sampling_params, input_ids, fields)
        self._check_open()
        if stream:
            return self._stream_sync(obj)
        return self._call(self.tokenizer_manager.generate(obj))

    def _stream_sync(self, obj: GenerateReqInput) -> Iterator[dict]:
        q: queue.Queue = queue.Queue()
        done = object()

        async def pump() -> None:
            try:
                async for item in self.tokenizer_manager.generate_stream(obj):
                    q.put(item)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                q.put(e)
            q.put(done)

        future = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while (item := q.get()) is not done:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            future.cancel()

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        *,
        stream: bool = False,
        **fields: Any,
    ) -> dict | list[dict] | AsyncIterator[dict]:
        """`generate` for asyncio callers."""
        obj = _request(prompt, sampling_params, input_ids, fields)
        self._check_open()
        if stream:
            return self._stream_async(obj)
        fut = asyncio.run_coroutine_threadsafe(self.tokenizer_manager.generate(obj), self._loop)
        return await asyncio.wrap_future(fut)

    async def _stream_async(self, obj: GenerateReqInput) -> AsyncIterator[dict]:
        agen = self.tokenizer_manager.generate_stream(obj)
        try:
            while True:
                fut = asyncio.run_coroutine_threadsafe(agen.__anext__(), self._loop)
                try:
                    yield await asyncio.wrap_future(fut)
                except StopAsyncIteration:
                    return
        finally:
            asyncio.run_coroutine_threadsafe(agen.aclose(), self._loop)

    # ------------------------------------------------------------------ control
    def flush_cache(self) -> bool:
        """Drop every cached prefix; refused (returns False) while requests run."""
        self._check_open()
        return self._call(self.tokenizer_manager.flush_cache()).ok

    def pin_prefix(
        self, name: str, text: str | None = None, input_ids: list[int] | None = None
    ) -> dict:
        """CAG: compute and pin a prefix (needs enable_hierarchical_cache); see /pin_prefix."""
        self._check_open()
        return self._call(self.tokenizer_manager.pin_prefix(name, text, input_ids))

    def unpin_prefix(self, name: str) -> dict:
        self._check_open()
        return self._call(self.tokenizer_manager.unpin_prefix(name))

    def list_pinned(self) -> list[dict]:
        self._check_open()
        return self._call(self.tokenizer_manager.list_pinned())

    def get_server_info(self) -> dict:
        self._check_open()
        from loom.runtime.server.common import public_args

        state = self._call(self.tokenizer_manager.get_internal_state())
        return {**public_args(self.server_args), **state}

    def abort_request(self, rid: str = "") -> None:
        self._loop.call_soon_threadsafe(self.tokenizer_manager.abort_request, rid)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("engine: already shut down")
        reason = getattr(getattr(self, "tokenizer_manager", None), "dead_reason", None)
        if reason:
            raise RuntimeError(f"engine: {reason}")

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        loop = getattr(self, "_loop", None)
        if loop is not None and loop.is_running():
            try:
                self._call(self.tokenizer_manager.close(), timeout=5)
            except Exception:  # noqa: BLE001 - best effort during shutdown
                pass
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join(timeout=5)
        from loom.runtime.server.launch import stop_processes

        stop_processes(self._procs)
        for ipc in getattr(self, "_ipcs", ()):
            ipc.remove()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass


def _request(prompt, sampling_params, input_ids, fields: dict) -> GenerateReqInput:
    unknown = sorted(set(fields) - GENERATE_FIELDS - {"stream"})
    if unknown:
        raise TypeError(f"generate: unexpected keyword argument(s) {', '.join(unknown)}")
    body = {"text": prompt, "input_ids": input_ids, "sampling_params": sampling_params}
    return decode_generate_request({**body, **fields})
