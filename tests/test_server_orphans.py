"""No process outlives its owner: SIGKILL a server or an Engine's process and every process it
started (fork server, resource tracker, scheduler, detokenizer) is gone within seconds; a clean
Engine.shutdown() leaves no child behind either."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil

from loom.runtime.server.runtime_client import Runtime


def wait_gone(procs: list[psutil.Process], timeout: float = 30.0) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return []
        time.sleep(0.2)
    return alive


def test_killing_the_server_leaves_no_orphans(tiny_model_dir):
    rt = Runtime(tiny_model_dir("llama"), max_total_tokens=1024)
    try:
        descendants = psutil.Process(rt.pid).children(recursive=True)
        assert len(descendants) >= 3, descendants  # fork server, scheduler, detokenizer
        if hasattr(os, "SCHED_BATCH"):  # runtime/process.py yield_to_scheduler
            policy = [os.sched_getscheduler(p.pid) & ~os.SCHED_RESET_ON_FORK for p in descendants]
            assert policy.count(os.SCHED_BATCH) == 1, policy  # the detokenizer only
            assert os.sched_getscheduler(rt.pid) & ~os.SCHED_RESET_ON_FORK == os.SCHED_BATCH
        os.kill(rt.pid, signal.SIGKILL)  # not reaped yet: the owner stays a zombie meanwhile
        left = wait_gone(descendants)
        assert not left, [(p.pid, p.cmdline()[:3]) for p in left]
    finally:
        rt.shutdown()


ENGINE_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import psutil
    import loom

    if __name__ == "__main__":
        engine = loom.Engine(sys.argv[1], max_total_tokens=1024)
        if sys.argv[2] == "shutdown":
            kids = psutil.Process().children(recursive=True)
            engine.shutdown()
            # a child may take a moment to exit on a loaded machine: wait (and reap) first
            _, kids = psutil.wait_procs(kids, timeout=30)
            print("CHILDREN", len(kids), [p.cmdline()[:3] for p in kids], flush=True)
        else:
            print("READY", flush=True)
            time.sleep(600)
    """
)


def test_killing_an_engine_process_leaves_no_orphans(tiny_model_dir, tmp_path):
    script = tmp_path / "engine_owner.py"
    script.write_text(ENGINE_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), tiny_model_dir("llama"), "kill"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "READY"
        descendants = psutil.Process(proc.pid).children(recursive=True)
        assert len(descendants) >= 3, descendants
        proc.send_signal(signal.SIGKILL)
        left = wait_gone(descendants)
        assert not left, [(p.pid, p.cmdline()[:3]) for p in left]
    finally:
        proc.kill()
        proc.wait(30)


def test_engine_shutdown_stops_its_fork_server(tiny_model_dir, tmp_path):
    script = tmp_path / "engine_owner.py"
    script.write_text(ENGINE_SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script), tiny_model_dir("llama"), "shutdown"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = next(x for x in out.stdout.splitlines() if x.startswith("CHILDREN"))
    assert line.startswith("CHILDREN 0"), line
