"""Translation workers die with the process that forked them (a SIGKILLed scheduler must not
leave them behind: each holds a copy of the scheduler's memory)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

CHILD = """
import os, sys, time
from loom.grammar.translation import TranslatorPool
pool = TranslatorPool(2)
pool.translate(("regex", "[a-z]+"), timeout=60)
print(*[w.proc.pid for w in pool._all], flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_workers_exit_when_their_parent_is_killed():
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        workers = [int(p) for p in proc.stdout.readline().split()]
        assert workers and all(_alive(p) for p in workers)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in workers), workers
