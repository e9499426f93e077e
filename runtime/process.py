"""Process plumbing: IPC endpoints, child-process setup and launch."""

from __future__ import annotations

import ast
import ctypes
import gc
import io
import logging
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from multiprocessing import popen_forkserver, spawn, util
from multiprocessing.context import reduction, set_spawning_popen
from multiprocessing.forkserver import read_signed as forkserver_read_signed


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

    def remove(self) -> None:
        """Delete the folder `fresh` made for these endpoints, once every process using them
        has stopped (each launch made one under /tmp and left it behind)."""
        folder = os.path.dirname(self.scheduler.removeprefix("ipc://"))
        if self.scheduler.startswith("ipc://") and os.path.basename(folder).startswith("loom-ipc-"):
            shutil.rmtree(folder, ignore_errors=True)


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="[%(asctime)s %(processName)s] %(levelname)s %(name)s: %(message)s",
        force=True,
    )


def freeze_startup_heap() -> None:
    """Move every object alive after start-up (torch, transformers, the model, the tokenizer)
    out of the garbage collector's sight: they live as long as the process, and a full
    collection would scan them all, a gap in every stream (measured: docs/benchmarks.md,
    "Figures moved out of module docstrings"); what is allocated later is still collected."""
    gc.collect()
    gc.freeze()


def yield_to_scheduler(args) -> bool:
    """On a CPU device (`args.resolved_device`), make the calling thread (and threads it
    starts later) SCHED_BATCH: it still gets its
    fair share of CPU, but waking up no longer preempts a running thread. For the threads that
    wake once per streamed token (the detokenizer, the tokenizer manager's event loop): on a
    CPU device the forward runs on the scheduler's thread, and as SCHED_NORMAL tasks they
    preempted it mid-step, 0.83 times per streamed token at batch 1 (0.22 as SCHED_BATCH; see
    docs/benchmarks.md "Session 8: the streamed chain yields to the scheduler"). Children
    forked from here start SCHED_NORMAL again (SCHED_RESET_ON_FORK), so a fork server or a
    scheduler started later is not affected. Returns False on another device, or where the OS
    has no such policy."""
    policy = getattr(os, "SCHED_BATCH", None)
    if policy is None or not hasattr(os, "sched_setscheduler") or args.resolved_device != "cpu":
        return False
    try:
        os.sched_setscheduler(0, policy | os.SCHED_RESET_ON_FORK, os.sched_param(0))
    except OSError:
        return False
    return True


def _alive(pid: int) -> bool:
    """False once `pid` has exited, also while it is an unreaped zombie (an owner killed by
    a signal stays one until its own parent waits for it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return True


def die_with_parent() -> None:
    """preexec_fn of a child server: SIGTERM it when the launching process dies (PR_SET_PDEATHSIG);
    runs in the child between fork and exec."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


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
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


# glibc's M_ARENA_MAX (malloc.h): at most this many malloc arenas. By default every thread
# that allocates gets one, up to 8 per core, and each keeps the memory freed into it; a
# scheduler's threads (compiles, the loop, torch's) held ~45 MB that way (VmHWM 549 -> 503
# MB on SmolLM2 at batch 1, docs/benchmarks.md "Issue 32: peak RSS of loom's process tree").
M_ARENA_MAX = -8
MALLOC_ARENAS = 2


def limit_malloc_arenas() -> bool:
    """mallopt(M_ARENA_MAX, MALLOC_ARENAS) in this process, before its threads start, unless
    the user set MALLOC_ARENA_MAX (glibc reads that itself). False where libc is not glibc."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_ARENA_MAX, MALLOC_ARENAS))
    except (OSError, AttributeError):
        return False


# glibc's M_MMAP_THRESHOLD (malloc.h): allocations at least this large get their own mapping,
# unmapped on free. Left dynamic, glibc raises the threshold to the size of each mapped chunk
# freed (up to 32 MB): after a tokenizer build frees its large buffers, a step's activations
# (SmolLM2 batch 32: 9-50 MB buffers of a 4,096-token prefill) come from the heap and stay
# resident after the step. Set, it stays put. 4 MB: decode-sized buffers are reused from the
# heap, prefill-sized ones go back (docs/benchmarks.md, "Issue 32: the scheduler without the
# grammar backend at start-up"; 128 KB, glibc's start value, measured within 8 MB of it).
# Set only after the fork server's imports: SmolLM2 batch 32 steady 826 MB with the mmap
# threshold alone (the trim one left where the imports' dynamic threshold had raised it), 635
# with both.
# M_TRIM_THRESHOLD: free bytes at the heap's top handed back at once. The dynamic threshold
# also raised it (to twice the mmap one) before this process set anything, so it is set too.
M_MMAP_THRESHOLD, M_TRIM_THRESHOLD = -3, -1
MMAP_THRESHOLD = 4 << 20
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD  # glibc's own ratio (128 KB measured worse: 738 MB)


def fix_mmap_threshold() -> bool:
    """mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD,
    TRIM_THRESHOLD) in this process, unless the user set MALLOC_MMAP_THRESHOLD_ (glibc reads
    that itself). False where libc is not glibc."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
            libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
        )
    except (OSError, AttributeError):
        return False


def release_free_heap() -> bool:
    """malloc_trim(0): hand the heap pages malloc holds free back to the kernel. Building a
    large tokenizer frees most of what it allocated (Gemma 3's: about four fifths,
    docs/benchmarks.md "Issue 32: the tokenizer's freed heap"), but glibc keeps freed chunks
    below the top of the heap resident. False where libc is not glibc."""
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


# libgomp's spin before a waiting thread sleeps (GOMP_SPINCOUNT: iterations of a ~16 ns pause
# loop here). Its default, 300,000 (~5 ms), is for a machine the team has to itself: with one
# more runnable process than cores, a thread spins through its whole slice at every barrier
# while its partner waits for that core (a batch-8 step has ~150 parallel regions; under load
# two threads then ran 16x slower than one). ~20 us is longer than the gaps between a forward's
# parallel regions (docs/benchmarks.md, "Issue 32: batch 8 on two threads").
OPENMP_SPIN_COUNT = 1000


def bound_openmp_spin() -> bool:
    """Set GOMP_SPINCOUNT to OPENMP_SPIN_COUNT in this process's environment, for the libgomp
    that torch loads after it (libgomp reads it once, when it is loaded: call this before
    `import torch`), unless the user chose a wait policy (GOMP_SPINCOUNT or OMP_WAIT_POLICY).
    True when it was set here."""
    if "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ:
        return False
    os.environ["GOMP_SPINCOUNT"] = str(OPENMP_SPIN_COUNT)
    return True


def configure_child_process(args, name: str, owner_pid: int) -> None:
    # what the fork server preloaded (torch, transformers) is shared with it page by page until
    # written: a collection here would write every tracked object's header and copy its page
    gc.freeze()
    limit_malloc_arenas()
    fix_mmap_threshold()
    mp.current_process().name = name
    configure_logging(args.log_level)
    _exit_with_parent(owner_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the owner decides when to stop


# Children start from a fork server that has already imported the heavy modules, so starting a
# scheduler costs a fork, not a fresh interpreter importing torch and transformers. A fork
# server is single-threaded, so forking it is safe whatever threads the caller runs.
# Which preload: runtime/preload_torch.py unless a parent's servers all run torch-free
# (`set_preload`). Each preload has its own fork server (loom's, not multiprocessing's global
# one), started with its first child: a fork server's memory is in every child's resident set,
# so a torch-free scheduler forked from torch's server would carry torch's ~213 MB of pages.
_PRELOAD = ["loom.runtime.preload_torch"]
_servers: dict = {}  # preload module -> its multiprocessing.forkserver.ForkServer


def set_preload(with_torch: bool) -> None:
    """Choose the preload of the children started next: without torch (runtime/preload.py)
    when the scheduler runs the torch-free runner, so neither it nor the detokenizer maps
    torch's ~213 MB. Each preload's children come from that preload's fork server, whatever
    another Engine of this process started before (docs/architecture.md, "One fork server
    per preload")."""
    _PRELOAD[:] = ["loom.runtime.preload_torch" if with_torch else "loom.runtime.preload"]


def _fork_server(preload: str):
    from multiprocessing import forkserver

    server = _servers.get(preload)
    if server is None:
        server = _servers[preload] = forkserver.ForkServer()
        # fork_server_exit first: its exit handler runs after the preload's (runtime/fork_server_exit.py)
        server.set_forkserver_preload(["loom.runtime.fork_server_exit", preload])
    return server


class _Popen(popen_forkserver.Popen):
    """multiprocessing's forkserver Popen through a given fork server instead of the module's
    single one: `_launch` is CPython's (3.10-3.13; CPython's main branch, read in December 2026,
    has the same body: 3.14's forkserver authentication lives inside connect_to_new_process)
    with the server's connect_to_new_process.
    The child side needs nothing: each fork server sets its own process's module-level
    server state before running a child (forkserver._serve_one)."""

    def __init__(self, process_obj, server):
        self._server = server
        super().__init__(process_obj)

    def _launch(self, process_obj):
        prep_data = spawn.get_preparation_data(process_obj._name)
        buf = io.BytesIO()
        set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            set_spawning_popen(None)
        self.sentinel, w = self._server.connect_to_new_process(self._fds)
        # a duplicate of the data pipe's write end: the child's sentinel of its parent
        parent_w = os.dup(w)
        self.finalizer = util.Finalize(self, util.close_fds, (parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver_read_signed(self.sentinel)


class _Process(mp.context.ForkServerProcess):
    """A forkserver Process started from the fork server of its `preload` (a module name,
    pickled with the process; the server itself holds a lock and stays in the parent).

    A fork server's children inherit its environment, the owner's when the server started;
    `loom_env`, the owner's LOOM_* variables when this child was started, replaces those in
    the child before its target runs, so a knob set (or unset) since then (LOOM_TORCH_RUNNER,
    which the scheduler reads again in runner_choice) is seen as the owner saw it."""

    preload = "loom.runtime.preload_torch"
    loom_env: dict[str, str] = {}

    def _Popen(self, process_obj):  # BaseProcess.start calls self._Popen(self)
        return _Popen(process_obj, _fork_server(self.preload))

    def run(self) -> None:
        for key in [k for k in os.environ if k.startswith("LOOM_")]:
            del os.environ[key]
        os.environ.update(self.loom_env)
        super().run()


_started: list[mp.Process] = []  # children started here (to know when a fork server is idle)
_owns_tracker = False  # whether loom brought up this process's multiprocessing resource tracker


def stop_fork_server_if_idle() -> None:
    """Stop each fork server once no child started from it is alive (owners call this after
    stopping their children), so no fork server outlives the Engines or servers that needed it
    (a torch one stops when the last torch-runner Engine does, while a torch-free one runs)."""
    _started[:] = [p for p in _started if p.is_alive()]
    busy = {p.preload for p in _started}
    for preload, server in list(_servers.items()):
        if preload not in busy:
            server._stop()
            del _servers[preload]
    if _owns_tracker and not _started:  # the tracker the fork servers brought up, unless it was
        from multiprocessing import resource_tracker

        resource_tracker._resource_tracker._stop()


def start_fork_server_early() -> None:
    """Bring up the fork server of the preload `set_preload` chose last without waiting for it:
    its preload (torch: seconds of imports) runs while the owner does its own start-up work,
    instead of after it, when the first `start_process` would start it."""
    global _owns_tracker
    from multiprocessing import resource_tracker

    if resource_tracker._resource_tracker._fd is None:  # as start_process: stopped when idle
        _owns_tracker = True
    _fork_server(_PRELOAD[0]).ensure_running()


def start_process(target, args: tuple, name: str) -> tuple[mp.Process, object]:
    """Start `target(*args, owner_pid, ready_pipe)` in a child process, from the fork server
    of the preload `set_preload` chose last; returns (process, reader end of its ready pipe)."""
    global _owns_tracker
    from multiprocessing import resource_tracker

    if resource_tracker._resource_tracker._fd is None:
        _owns_tracker = True
    reader, writer = mp.Pipe(duplex=False)
    # Not daemonic: the scheduler starts helper processes of its own (grammar translation
    # workers), which daemonic processes may not. Owners stop their children explicitly
    # (Engine.shutdown, launch_server's finally), and an orphan exits with its owner
    # (_exit_with_parent).
    proc = _Process(target=target, args=(*args, os.getpid(), writer), name=name, daemon=False)
    proc.preload = _PRELOAD[0]
    proc.loom_env = {k: v for k, v in os.environ.items() if k.startswith("LOOM_")}
    proc.start()
    _started.append(proc)
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


def wait_all_ready(started: list, timeout: float) -> list[dict]:
    """wait_ready for several processes that start together: the first to fail (or exit)
    raises, so a rank that dies during start-up does not leave the others waiting for it."""
    deadline = time.monotonic() + timeout
    msgs: list = [None] * len(started)
    while time.monotonic() < deadline:
        for i, (proc, reader) in enumerate(started):
            if msgs[i] is None and (reader.poll(0) or not proc.is_alive()):
                try:
                    msgs[i] = wait_ready(proc, reader, 1.0)
                except RuntimeError as e:
                    # a rank's own error first: its peers then fail only on the lost connection
                    raise RuntimeError("; ".join([str(e), *_other_errors(started, i)])) from None
        if all(m is not None for m in msgs):
            return msgs
        time.sleep(0.05)
    waiting = [p.name for (p, _), m in zip(started, msgs) if m is None]
    raise RuntimeError(f"{', '.join(waiting)} did not start within {timeout:g} s")


def _other_errors(started: list, failed: int, wait: float = 1.0) -> list[str]:
    errors = []
    for i, (_, reader) in enumerate(started):
        try:
            if i != failed and reader.poll(wait):
                msg = reader.recv()
                if "error" in msg:
                    errors.append(msg["error"])
        except (EOFError, OSError):
            pass
    return errors


def check_main_guard(what: str) -> None:
    """Raise if `what` is being created by a script's top-level code outside an
    `if __name__ == "__main__":` block: every child process re-imports the main script (the
    forkserver start method), would run that code again and die during start-up."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path or not os.path.isfile(path):
        return  # an interactive session or `python -c`: nothing is re-imported
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__":
            break
        frame = frame.f_back
    if frame is None or _inside_main_guard(path, frame.f_lineno):
        return
    raise RuntimeError(
        f"{what} is created at the top level of {path} (line {frame.f_lineno}). loom starts "
        "child processes, and each re-imports the main script, so it must be created under "
        '`if __name__ == "__main__":` (or in a function called from there).'
    )


def _inside_main_guard(path: str, line: int) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, UnicodeDecodeError):
        return True  # cannot tell: do not stand in the way
    for node in tree.body:
        if isinstance(node, ast.If) and _is_main_test(node.test):
            if node.lineno <= line <= (node.end_lineno or node.lineno):
                return True
    return False


def _is_main_test(test: ast.expr) -> bool:
    if not (isinstance(test, ast.Compare) and len(test.comparators) == 1):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s.id for s in sides if isinstance(s, ast.Name)]
    consts = [s.value for s in sides if isinstance(s, ast.Constant)]
    return names == ["__name__"] and consts == ["__main__"]
