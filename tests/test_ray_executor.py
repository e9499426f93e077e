"""`--distributed-executor-backend ray` (runtime/ray_executor.py) on a local two-node Ray
cluster: a head node that holds no CPUs (the usual head-node set-up) and a second node with
two, so every Ray-placed rank lands on the second node. TP=2 and PP=2 on the bundled model
give the same greedy tokens as one rank; a SIGKILLed rank actor ends the Engine with an error
naming the rank; `loom serve --dp-size 2` places its replicas as Ray actors."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

import loom
from loom.runtime.server.runtime_client import free_port

ray = pytest.importorskip("ray")

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "def fib(n):"]
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
RAY = str(Path(sys.executable).with_name("ray"))


def _start_node(argv: list[str], log: Path, timeout: float = 180) -> subprocess.Popen:
    """`ray start ... --block`: the CLI stays in the foreground and stops the node's processes
    when it is terminated, so the fixture stops exactly what it started."""
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.Popen([RAY, "start", "--block", "--disable-usage-stats", *argv],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)  # fmt: skip
    deadline = time.monotonic() + timeout
    while "Ray runtime started" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"ray start failed:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    return proc


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(address, node_a id, node_b id) of a head node (no CPUs, resource node_a) and a second
    node (2 CPUs, resource node_b) on this machine. Start-up time is printed (-s)."""
    root = tmp_path_factory.mktemp("ray")
    port = free_port()  # ephemeral: outside Ray's default worker port range 10002-19999
    t0 = time.monotonic()
    head = _start_node(["--head", f"--port={port}", "--num-cpus=0",
                        '--resources={"node_a": 1}', f"--temp-dir={root}"], root / "head.log")  # fmt: skip
    nodes = [head]
    try:
        t1 = time.monotonic()
        nodes.append(_start_node([f"--address=127.0.0.1:{port}", "--num-cpus=2",
                                  '--resources={"node_b": 1}'], root / "node_b.log"))  # fmt: skip
        t2 = time.monotonic()
        print(f"ray cluster: head {t1 - t0:.1f} s, second node {t2 - t1:.1f} s, "
              f"load {os.getloadavg()[0]:.1f}")  # fmt: skip
        ray.init(address=f"127.0.0.1:{port}", log_to_driver=False)
        ids = {}
        for node in ray.nodes():
            for name in ("node_a", "node_b"):
                if node["Alive"] and name in node["Resources"]:
                    ids[name] = node["NodeID"]
        yield f"127.0.0.1:{port}", ids["node_a"], ids["node_b"]
    finally:
        ray.shutdown()
        for proc in reversed(nodes):
            _stop(proc)


@pytest.fixture(scope="module")
def one_rank():
    engine = loom.Engine(max_total_tokens=2048)
    try:
        yield [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)]
    finally:
        engine.shutdown()


def _ray_ranks(engine, node_b: str) -> list[dict]:
    ranks = engine.scheduler_info["parallel"]["ranks"]
    assert "ray_node_id" not in ranks[0]  # rank 0 owns the sockets: it stays in this node
    assert [r["ray_node_id"] for r in ranks[1:]] == [node_b] * (len(ranks) - 1)
    assert all(r["pid"] != os.getpid() for r in ranks)
    return ranks


@pytest.mark.parametrize("layout", [{"tp_size": 2}, {"pp_size": 2}], ids=["tp2", "pp2"])
def test_ranks_placed_by_ray_match_one_rank(cluster, one_rank, layout):
    address, _, node_b = cluster
    t0 = time.monotonic()
    engine = loom.Engine(max_total_tokens=2048, distributed_executor_backend="ray",
                         ray_address=address, **layout)  # fmt: skip
    try:
        print(f"{layout}: Engine up in {time.monotonic() - t0:.1f} s")
        ranks = _ray_ranks(engine, node_b)
        assert len(ranks) == 2
        if "tp_size" in layout:  # each rank holds half the KV heads
            assert ranks[0]["kv_cache_bytes"] == ranks[1]["kv_cache_bytes"]
        got = [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)]
        assert got == one_rank
        assert engine.generate(PROMPTS[0], GREEDY)["output_ids"] == one_rank[0]
    finally:
        engine.shutdown()


def test_a_killed_rank_actor_ends_the_engine_naming_the_rank(cluster, one_rank):
    address, _, node_b = cluster
    engine = loom.Engine(max_total_tokens=2048, distributed_executor_backend="ray",
                         ray_address=address, tp_size=2)  # fmt: skip
    try:
        pid = _ray_ranks(engine, node_b)[1]["pid"]
        assert engine.generate(PROMPTS[0], GREEDY)["output_ids"] == one_rank[0]
        os.kill(pid, signal.SIGKILL)  # the actor's worker process
        t0 = time.monotonic()
        while engine.tokenizer_manager.dead_reason is None and time.monotonic() - t0 < 10:
            time.sleep(0.1)
        elapsed = time.monotonic() - t0
        with pytest.raises(RuntimeError, match=r"scheduler-rank1 \(Ray actor\) process died"):
            engine.generate(PROMPTS[0], GREEDY)
        assert elapsed < 10, elapsed
        print(f"killed rank actor seen in {elapsed:.2f} s")
    finally:
        engine.shutdown()
    assert ray.get_actor  # the cluster itself survives: a new actor still starts
    assert ray.get(ray.remote(lambda: 7).options(num_cpus=1).remote(), timeout=120) == 7


def test_ray_backend_needs_something_to_place():
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        loom.Engine(distributed_executor_backend="ray")
    with pytest.raises(ValueError, match="ray_address"):
        loom.Engine(tp_size=2, ray_address="127.0.0.1:6379")


def _serve(address: str, log: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    """`loom serve ... --distributed-executor-backend ray`, once /health answers 200."""
    port = free_port()
    argv = [sys.executable, "-m", "loom.launch_server", "--port", str(port),
            "--max-total-tokens", "2048", "--distributed-executor-backend", "ray",
            "--ray-address", address, *flags]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 400
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(log.read_text()[-3000:])
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except requests.RequestException:
            pass
        time.sleep(0.5)


def test_serve_tp2_a_killed_rank_actor_exits_1_naming_the_rank(cluster, one_rank, tmp_path):
    address, _, _ = cluster
    log = tmp_path / "serve.log"
    proc, url = _serve(address, log, "--tp-size", "2")
    try:
        res = requests.post(url + "/generate", json={"text": PROMPTS[1], "sampling_params": GREEDY}, timeout=120)  # fmt: skip
        assert res.json()["output_ids"] == one_rank[1]
        pids = requests.get(url + "/get_server_info", timeout=30).json()["process_pids"]
        os.kill(pids["scheduler-rank1 (Ray actor)"], signal.SIGKILL)
        t0 = time.monotonic()
        assert proc.wait(60) == 1  # the bound only catches a hang; the time is asserted below
        elapsed = time.monotonic() - t0
        text = log.read_text()
        assert "the scheduler-rank1 (Ray actor) process died" in text, text[-3000:]
        assert elapsed < 10, elapsed
        print(f"server exited {elapsed:.2f} s after the rank actor was killed")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_serve_dp2_places_replicas_as_ray_actors(cluster, one_rank, tmp_path):
    """`loom serve --dp-size 2 --distributed-executor-backend ray`: both replicas on the node
    with CPUs, outputs equal to one replica's."""
    address, _, node_b = cluster
    log = tmp_path / "serve.log"
    proc, url = _serve(address, log, "--dp-size", "2")
    try:
        placed = re.findall(r"dp replica (\d) on Ray node (\w+)", log.read_text())
        assert sorted(placed) == [("0", node_b), ("1", node_b)], log.read_text()[-3000:]
        for _ in range(2):  # round robin: each prompt list once per replica
            for prompt, want in zip(PROMPTS, one_rank):
                res = requests.post(url + "/generate", json={"text": prompt, "sampling_params": GREEDY}, timeout=120)  # fmt: skip
                assert res.status_code == 200, res.text
                assert res.json()["output_ids"] == want
    finally:
        proc.terminate()
        try:
            assert proc.wait(90) == 0, log.read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
