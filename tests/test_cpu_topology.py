"""The default thread count counts cores this process may use, not the host's logical CPUs."""

from __future__ import annotations

import os

from loom.runtime.cpu_topology import physical_cores
from loom.runtime.server_args import ServerArgs


def test_smt_siblings_count_once_and_the_quota_caps():
    pairs = {0: "0,4", 4: "0,4", 1: "1,5", 5: "1,5", 2: "2", 3: "3"}
    assert physical_cores([0, 4, 1, 5, 2, 3], pairs.__getitem__) == 4
    assert physical_cores([0, 4], pairs.__getitem__) == 1  # taskset to one core's two threads
    assert physical_cores([0, 1, 2, 3], pairs.__getitem__, quota=1.5) == 2
    assert physical_cores([], pairs.__getitem__) == 1


def test_the_default_leaves_a_core_and_never_exceeds_the_affinity_set():
    threads = ServerArgs().effective_cpu_threads
    assert 1 <= threads <= max(1, len(os.sched_getaffinity(0)) - 1)
    assert threads == max(1, physical_cores() - 1)
    assert ServerArgs(cpu_threads=3).effective_cpu_threads == 3
