"""runtime/process.py's fork servers, one per preload: in one process, an Engine on the torch
runner started before a GGUF Engine on default flags no longer hands the second its fork
server (torch's ~213 MB in the torch-free scheduler and detokenizer); each preload's server
stops once its last child has."""

from __future__ import annotations

import json
import os

import pytest

from loom.runtime import cpu_abi
from tests.runtime_helpers import run_child

pytestmark = pytest.mark.skipif(cpu_abi.load() is None, reason="no C compiler")

_TWO_ENGINES = r"""
import json
import os
import sys

import loom
from loom.runtime import process


def maps_torch(pid):
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()


def running(pid):
    return pid is not None and os.path.exists(f"/proc/{pid}")


prompts = [[1, 504, 3458, 282, 4649, 314, 2], [1, 1205, 42, 7]]
params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
out = {}
os.environ["LOOM_TORCH_RUNNER"] = "1"
first = loom.Engine(sys.argv[1], max_total_tokens=1024)
del os.environ["LOOM_TORCH_RUNNER"]  # the second Engine: default flags
with loom.Engine(sys.argv[1], max_total_tokens=1024) as second:
    out["torch_ids"] = [o["output_ids"] for o in first.generate(input_ids=prompts, sampling_params=params)]
    out["free_ids"] = [o["output_ids"] for o in second.generate(input_ids=prompts, sampling_params=params)]
    out["torch_maps"] = [maps_torch(p.pid) for p in first._procs]
    out["free_maps"] = [maps_torch(p.pid) for p in second._procs]
    servers = {k: s._forkserver_pid for k, s in process._servers.items()}
    out["servers"] = sorted(servers)
    first.shutdown()  # the torch fork server goes with its last child; the other stays
    out["after_first"] = sorted(process._servers)
    out["torch_server_gone"] = not running(servers.get("loom.runtime.preload_torch"))
    out["still_serves"] = second.generate(input_ids=prompts[:1], sampling_params=params)[0]["output_ids"]
out["left"] = sorted(process._servers)
out["free_server_gone"] = not running(servers.get("loom.runtime.preload"))
print(json.dumps(out))
"""


def test_a_gguf_engine_after_a_torch_runner_engine_gets_the_torch_free_fork_server(real_gguf):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = json.loads(run_child(_TWO_ENGINES, real_gguf("smollm2"), timeout=600, cwd=root)[-1])
    assert out["torch_ids"] == out["free_ids"]  # both serve, the same greedy tokens
    assert all(len(ids) == 6 for ids in out["free_ids"])
    assert out["torch_maps"] == [True, True]  # the probe sees torch where it is
    assert out["free_maps"] == [False, False]  # the second's scheduler and detokenizer
    assert out["servers"] == ["loom.runtime.preload", "loom.runtime.preload_torch"]
    assert out["after_first"] == ["loom.runtime.preload"] and out["torch_server_gone"]
    assert out["still_serves"] == out["free_ids"][0]
    assert out["left"] == [] and out["free_server_gone"]
