"""loom's children run torch's libgomp with a bounded spin (runtime/process.py,
bound_openmp_spin): with libgomp's default (~5 ms of spinning at every barrier) a two-thread
scheduler on a busy 2-core machine ran a batch-8 decode ~16x slower than with the bound
(docs/benchmarks.md, "Issue 32: batch 8 on two threads"). libgomp reads GOMP_SPINCOUNT once,
when it is loaded, so the fork server must set it before its preload imports torch; a wait
policy the user chose wins."""

from __future__ import annotations

import os
import subprocess
import sys

from loom.runtime import process
from loom.runtime.process import OPENMP_SPIN_COUNT

CHECK = """
import os, sys
from loom.runtime.process import bound_openmp_spin
print(bound_openmp_spin(), os.environ.get("GOMP_SPINCOUNT"), "torch" in sys.modules)
"""


def run_check(**env: str) -> list[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    done = subprocess.run(
        [sys.executable, "-c", CHECK], env={**base, **env}, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


def test_bound_is_set_before_torch_and_user_choices_win():
    # process.py does not import torch: the fork server's preload sets the bound first
    assert run_check() == ["True", str(OPENMP_SPIN_COUNT), "False"]
    assert run_check(GOMP_SPINCOUNT="50") == ["False", "50", "False"]
    assert run_check(OMP_WAIT_POLICY="active") == ["False", "None", "False"]


def _report_spin(owner_pid: int, ready_pipe) -> None:
    import torch  # noqa: F401  (preloaded by the fork server: already in sys.modules)

    ready_pipe.send({"spin": os.environ.get("GOMP_SPINCOUNT")})


def test_fork_server_children_get_the_bound():
    if "OMP_WAIT_POLICY" in os.environ:
        want = os.environ.get("GOMP_SPINCOUNT")
    else:
        want = os.environ.get("GOMP_SPINCOUNT", str(OPENMP_SPIN_COUNT))
    proc, reader = process.start_process(_report_spin, (), "spin-check")
    try:
        assert process.wait_ready(proc, reader, timeout=120) == {"spin": want}
    finally:
        proc.join(30)
        process.stop_fork_server_if_idle()
