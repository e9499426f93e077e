"""The process that owns an Engine (the user's) holds the tokenizer and the request state, not
the model: it must not import torch (~200 MB of resident memory per process; docs/benchmarks.md
"Issue 32: peak RSS of loom's process tree"). Only the scheduler ranks, started from the fork
server that preloads it, do. Each case runs in a fresh interpreter: this test process has torch."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import sys
import loom

if __name__ == "__main__":
    engine = loom.Engine(None if sys.argv[1] == "bundled" else sys.argv[1], log_level="warning",
                         random_seed=0, max_total_tokens=512)
    try:
        params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
        out = engine.generate("Hello", params)
        assert out["meta_info"]["completion_tokens"] == 4, out
    finally:
        engine.shutdown()
    print("torch" in sys.modules, "loom.runtime.model_runner" in sys.modules)
"""


def owner_imports(model: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, model], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()[-2:]


def test_engine_owner_does_not_import_torch_bundled():
    assert owner_imports("bundled") == ["False", "False"]


def test_engine_owner_does_not_import_torch_gguf(real_gguf):
    assert owner_imports(real_gguf("smollm2")) == ["False", "False"]


ARENAS = """
import ctypes, os, sys, tempfile, threading
from loom.runtime.process import MALLOC_ARENAS, limit_malloc_arenas

if sys.argv[1] == "limit":
    assert limit_malloc_arenas()
keep = []
together = threading.Barrier(6)
def work():  # all alive at once: a finished thread's arena would go to the next one
    together.wait()
    keep.append([bytearray(4096) for _ in range(64)])  # glibc malloc, not pymalloc
    together.wait()
threads = [threading.Thread(target=work) for _ in range(6)]
for t in threads:
    t.start()
for t in threads:
    t.join()
libc = ctypes.CDLL("libc.so.6")
libc.fopen.restype = ctypes.c_void_p
path = tempfile.mktemp()
fp = libc.fopen(path.encode(), b"w")
libc.malloc_info(0, ctypes.c_void_p(fp))
libc.fclose(ctypes.c_void_p(fp))
print(open(path).read().count("<heap nr="), MALLOC_ARENAS)
os.remove(path)
"""


def arenas(mode: str) -> tuple[int, int]:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    done = subprocess.run([sys.executable, "-c", ARENAS, mode], capture_output=True, text=True,
                          timeout=60, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    heaps, limit = map(int, done.stdout.split())
    return heaps, limit


def test_child_processes_limit_malloc_arenas():
    """configure_child_process's mallopt(M_ARENA_MAX) holds the arenas of a process whose
    threads allocate to MALLOC_ARENAS (without it each thread gets its own)."""
    heaps, limit = arenas("limit")
    assert heaps <= limit
    heaps, _ = arenas("default")
    assert heaps > limit


MMAP = """
import ctypes, sys
from loom.runtime.process import MMAP_THRESHOLD, fix_mmap_threshold

if sys.argv[1] == "fixed":
    assert fix_mmap_threshold()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = Info
libc.free(libc.malloc(24 << 20))  # a large mapped chunk freed (a tokenizer build's buffers)
before = libc.mallinfo2().hblkhd
p = libc.malloc(2 * MMAP_THRESHOLD)  # a prefill step's buffer
print(libc.mallinfo2().hblkhd - before >= 2 * MMAP_THRESHOLD)
libc.free(p)
"""


def mapped_after_a_large_free(mode: str) -> bool:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    done = subprocess.run([sys.executable, "-c", MMAP, mode], capture_output=True, text=True,
                          timeout=60, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()[-1] == "True"


def test_child_processes_fix_the_mmap_threshold():
    """configure_child_process's mallopt(M_MMAP_THRESHOLD) keeps a buffer over MMAP_THRESHOLD
    in its own mapping (unmapped on free) after a larger mapped chunk was freed; glibc's
    dynamic threshold would have risen to that chunk's size and served it from the heap,
    where it stays resident after the step (docs/benchmarks.md)."""
    assert mapped_after_a_large_free("fixed")
    assert not mapped_after_a_large_free("default")
