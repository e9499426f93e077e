"""Process plumbing: IPC endpoints, child-process setup and launch."""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import signal
import tempfile
import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class IPCNames:
    scheduler: str
    detokenizer: str
    tokenizer: str

    @classmethod
    def fresh(cls) -> IPCNames:
        folder = tempfile.mkdtemp(prefix="loom-ipc-")
        return cls(
            *(f"ipc://{folder}/{name}" for name in ("scheduler", "detokenizer", "tokenizer"))
        )


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="[%(asctime)s %(processName)s] %(levelname)s %(name)s: %(message)s",
        force=True,
    )


def _exit_with_parent(parent_pid: int) -> None:
    """Die when the parent dies, so no process outlives the server."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def configure_child_process(args, name: str) -> None:
    mp.current_process().name = name
    configure_logging(args.log_level)
    _exit_with_parent(int(os.environ.get("LOOM_PARENT_PID", os.getppid())))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop


def start_process(target, args: tuple, name: str) -> tuple[mp.Process, object]:
    """Start `target(*args, ready_pipe)` in a spawned process; returns (process, reader end)."""
    ctx = mp.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    os.environ["LOOM_PARENT_PID"] = str(os.getpid())
    proc = ctx.Process(target=target, args=(*args, writer), name=name, daemon=True)
    proc.start()
    writer.close()
    return proc, reader


def wait_ready(proc: mp.Process, reader, timeout: float) -> dict:
    """Wait for a child's ready message; raise with its error if it failed to start."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if reader.poll(0.1):
            try:
                msg = reader.recv()
            except EOFError:
                break
            if "error" in msg:
                raise RuntimeError(msg["error"])
            return msg
        if not proc.is_alive():
            break
    code = proc.exitcode
    raise RuntimeError(f"{proc.name} process exited during start-up (exit code {code})")
