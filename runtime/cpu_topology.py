"""How many CPU cores this process may really use (no torch import: ServerArgs reads it).

`os.cpu_count()` counts the host's logical CPUs: it ignores the affinity mask (taskset,
cpusets), a cgroup CPU quota (`docker --cpus`) and that two SMT siblings share one core's
execution units, so a default thread count built on it oversubscribes the machine.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable
from pathlib import Path


def _siblings(cpu: int) -> str:
    path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
    try:
        return path.read_text().strip()
    except OSError:
        return str(cpu)


def _quota() -> float | None:
    """CPUs granted by a cgroup v2 quota ("max" or absent: none)."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def physical_cores(
    cpus: Iterable[int] | None = None,
    siblings: Callable[[int], str] = _siblings,
    quota: float | None = None,
) -> int:
    """Cores among `cpus` (default: this process's affinity set), SMT siblings counted once,
    capped by the cgroup quota (rounded up)."""
    if cpus is None:
        try:
            cpus = os.sched_getaffinity(0)
        except AttributeError:  # not on Linux
            cpus = range(os.cpu_count() or 1)
        quota = _quota() if quota is None else quota
    cores = len({siblings(c) for c in cpus})
    if quota is not None:
        cores = min(cores, math.ceil(quota))
    return max(1, cores)
