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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _exit_with_parent(owner_pid: int) -> None:
    """Die when the process that started us dies, so no process outlives the server. The
    direct parent is the fork server, which itself dies with the owner (PR_SET_PDEATHSIG
    covers that hop); the watch thread covers the owner directly."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass

    def watch() -> None:
        while _alive(owner_pid):
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def configure_child_process(args, name: str, owner_pid: int) -> None:
    mp.current_process().name = name
    configure_logging(args.log_level)
    _exit_with_parent(owner_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the owner decides when to stop


# Children start from a fork server that has already imported the heavy modules, so starting a
# scheduler costs a fork, not a fresh interpreter importing torch and transformers. The fork
# server itself is single-threaded, so forking it is safe whatever threads the caller runs.
_PRELOAD = ["loom.runtime.preload"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def start_process(target, args: tuple, name: str) -> tuple[mp.Process, object]:
    """Start `target(*args, owner_pid, ready_pipe)` in a child process; returns (process, reader
    end of its ready pipe)."""
    ctx = _context()
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=target, args=(*args, os.getpid(), writer), name=name, daemon=True)
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
