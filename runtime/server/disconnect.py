"""Cancel a non-streaming call when its HTTP client goes away (server and router share it)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request


async def unless_disconnected(
    request: Request, coro: Awaitable, on_disconnect: Callable[[], Any]
) -> Any:
    """Await `coro`, cancelling it if the client disconnects first (the server then aborts the
    request and frees its KV; the router closes its upstream call, so the worker does the same);
    a cancelled call returns `on_disconnect()`, which may raise instead."""
    task = asyncio.ensure_future(coro)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled():
        return on_disconnect()
    return task.result()
