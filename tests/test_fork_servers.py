"""runtime/process.py's fork servers, one per preload: in one process, an Engine on the torch
runner started before a GGUF Engine on default flags no longer hands the second its fork
server (torch's ~213 MB in the torch-free scheduler and detokenizer); a child sees the owner's
LOOM_* variables as they were when it started, not its fork server's; each preload's server
stops once its last child has."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from loom.runtime import cpu_abi

pytestmark = pytest.mark.skipif(cpu_abi.load() is None, reason="no C compiler")

_ENGINES = r"""
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


def ids(engine, prompts):
    return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]


prompts = [[1, 504, 3458, 282, 4649, 314, 2], [1, 1205, 42, 7]]
params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
out = {}
# the torch runner by its flags: its fork server starts without LOOM_TORCH_RUNNER
first = loom.Engine(sys.argv[1], max_total_tokens=1024, speculative_algorithm="ngram")
with loom.Engine(sys.argv[1], max_total_tokens=1024) as second:  # default flags
    out["spec_ids"] = ids(first, prompts)
    out["free_ids"] = ids(second, prompts)
    out["torch_maps"] = [maps_torch(p.pid) for p in first._procs]
    out["free_maps"] = [maps_torch(p.pid) for p in second._procs]
    # torch's server again, for LOOM_TORCH_RUNNER=1 set after it started: the scheduler
    # (which reads it again) must see it as the owner does, and log the torch runner
    os.environ["LOOM_TORCH_RUNNER"] = "1"
    with loom.Engine(sys.argv[1], max_total_tokens=1024, log_level="info") as third:
        out["torch_ids"] = ids(third, prompts)
    del os.environ["LOOM_TORCH_RUNNER"]
    servers = {k: s._forkserver_pid for k, s in process._servers.items()}
    out["servers"] = sorted(servers)
    first.shutdown()  # the torch fork server goes with its last child; the other stays
    out["after_first"] = sorted(process._servers)
    out["torch_server_gone"] = not running(servers.get("loom.runtime.preload_torch"))
    out["still_serves"] = ids(second, prompts[:1])[0]
out["left"] = sorted(process._servers)
out["free_server_gone"] = not running(servers.get("loom.runtime.preload"))
print(json.dumps(out))
"""


def test_each_engine_gets_the_fork_server_its_runner_needs(real_gguf):
    """A speculative (torch-runner) Engine, then a GGUF Engine on default flags, then one with
    LOOM_TORCH_RUNNER=1 set after torch's fork server started, in one fresh interpreter."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-c", _ENGINES, real_gguf("smollm2")], cwd=root,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["torch_ids"] == out["free_ids"]  # both runners serve the same greedy tokens
    assert all(len(ids) == 6 for ids in out["free_ids"] + out["spec_ids"])
    assert out["torch_maps"] == [True, True]  # the probe sees torch where it is
    assert out["free_maps"] == [False, False]  # the second's scheduler and detokenizer
    assert "model runner: torch (LOOM_TORCH_RUNNER=1)" in run.stderr  # the third's scheduler
    assert out["servers"] == ["loom.runtime.preload", "loom.runtime.preload_torch"]
    assert out["after_first"] == ["loom.runtime.preload"] and out["torch_server_gone"]
    assert out["still_serves"] == out["free_ids"][0]
    assert out["left"] == [] and out["free_server_gone"]


_TEARDOWN = r"""
import json
import os
import sys
from multiprocessing import forkserver

from loom.runtime import process

out = {}
for name, with_exit in (("skip", True), ("full", False)):
    server = forkserver.ForkServer()  # the preload _fork_server gives, or it without the exit
    mods = [f"probe_{name}"]
    server.set_forkserver_preload(["loom.runtime.fork_server_exit", *mods] if with_exit else mods)
    process._servers[f"probe_{name}"] = server
    p = process._Process(target=os.getpid)
    p.preload = f"probe_{name}"
    p.start()
    p.join()
    server._stop()
    del process._servers[f"probe_{name}"]
    out[name] = {"child": p.exitcode, "files": sorted(os.listdir(os.path.join(sys.argv[1], name)))}
print(json.dumps(out))
"""

_PROBE = r"""
import atexit
import os

HERE = {here!r}


def _mark(what, _open=os.open, _close=os.close):
    _close(_open(os.path.join(HERE, what), os.O_CREAT | os.O_WRONLY))


atexit.register(_mark, "atexit")  # a preload's own exit handler: must still run


class _Torn:
    def __del__(self, _mark=_mark):  # runs when the interpreter frees this module
        _mark("teardown")


kept = _Torn()
"""


def test_a_fork_server_leaves_without_the_interpreters_teardown(tmp_path):
    """runtime/fork_server_exit.py, first in every server's preload: the preload's exit
    handlers run, the module teardown (seconds of freeing torch that an Engine's stop waited
    for) does not; the same server without it tears down, so the probe can see the difference."""
    for name in ("skip", "full"):
        (tmp_path / name).mkdir()
        (tmp_path / f"probe_{name}.py").write_text(_PROBE.format(here=str(tmp_path / name)))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", _TEARDOWN, str(tmp_path)], cwd=root, env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["skip"] == {"child": 0, "files": ["atexit"]}
    assert out["full"] == {"child": 0, "files": ["atexit", "teardown"]}
