"""Tensor / expert parallelism through the real server process layout (one process per rank,
gloo on CPU), checked against the single-rank scheduler run in this process: greedy tokens
identical and prompt logprobs within 1e-4, with chunked prefill, a radix-cache hit and a
grammar-constrained request in the batches. One server per layout, tiny models."""

from __future__ import annotations

import functools
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from loom.runtime.parallel_worker import rank_info
from loom.runtime.server.runtime_client import Runtime, free_port, server_argv
from loom.runtime.server_args import ServerArgs
from tests.runtime_helpers import make_scheduler, run_all, submit
from tests.server_helpers import server_info, wait_idle_and_intact
from tests.tiny_models import MODEL_VOCAB

CHUNK = 16
PREFIX = list(range(10, 40))  # 30 tokens: the later request finds them in the radix cache
REGEX = "[0-9]{3}-[a-z]{2}"
FIRST = [  # (input ids, extra sampling params): sent together, as one batch
    (PREFIX + [50, 51], {}),  # 32 tokens: prefilled in chunks of 16
    (PREFIX[:20] + [60], {}),
    ([7, 8, 9], {}),
    ([11, 12, 13], {"regex": REGEX, "ignore_eos": False, "max_new_tokens": 16}),
]
LATER = [(PREFIX + [70, 71, 72], {})]


def _params(extra: dict) -> dict:
    return {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True, **extra}


def _generate(url: str, batch: list, logprob_start: int) -> list[dict]:
    body = {
        "input_ids": [ids for ids, _ in batch],
        "sampling_params": [_params(extra) for _, extra in batch],
        "return_logprob": True,
        "logprob_start_len": logprob_start,
    }
    res = requests.post(url + "/generate", json=body, timeout=120)
    assert res.status_code == 200, res.text
    return res.json()


@functools.cache  # several layouts serve the same model
def _reference(path: str) -> list:
    """(output ids, prompt logprobs) of every request on one rank, in this process."""
    sched = make_scheduler(path, chunked_prefill_size=CHUNK, max_total_tokens=2048)
    out = []
    for batch, start in ((FIRST, 0), (LATER, len(PREFIX))):
        for i, (ids, extra) in enumerate(batch):
            lp = dict(return_logprob=True, logprob_start_len=start)
            submit(sched, str(i), ids, _params(extra), **lp)
        results = run_all(sched)
        out += [(results[str(i)].ids, results[str(i)].input_logprobs) for i in range(len(batch))]
    return out


def _check_same_as_one_rank(url: str, path: str) -> list[dict]:
    # prompt logprobs from 0 in the first batch; the later one scores only its new tokens, so
    # the cached prefix is used (a cached token has no logits to score it with)
    got = _generate(url, FIRST, 0) + _generate(url, LATER, len(PREFIX))
    want = _reference(path)
    for (ids, lps), item in zip(want, got):
        assert item["output_ids"] == ids
        theirs = [t[0] for t in item["meta_info"]["input_token_logprobs"]][1:]
        ours = [x[0] if isinstance(x, (list, tuple)) else x for x in lps][-len(theirs) :]
        assert len(theirs) == len(ours) > 0
        assert max(abs(a - b) for a, b in zip(theirs, ours)) < 1e-4
    regex_out = got[3]["text"]
    assert re.fullmatch(REGEX, regex_out), regex_out
    # radix hit across ranks (the last prefix position is recomputed: it scores token 30)
    assert got[-1]["meta_info"]["cached_tokens"] == len(PREFIX) - 1
    return got


def _check_expert_counts(before: dict, after: dict, got: list[dict], top_k: int = 2) -> None:
    """Between two reads of the counters, every MoE layer routed each computed token to top_k
    experts: the prompts less their cached prefixes, and every output token but the last
    (which is never fed back); the regex request may recompute its own tokens once more
    (jump-forward re-feeds the forced text). A double-counted or dropped token fails it."""
    tokens = [
        item["meta_info"]["prompt_tokens"] - item["meta_info"]["cached_tokens"]
        + len(item["output_ids"]) - 1
        for item in got
    ]  # fmt: skip
    assert after, "no MoE layer reported its expert counts"
    for layer, per_expert in after.items():
        routed = sum(per_expert) - sum(before.get(layer, [0] * len(per_expert)))
        assert top_k * sum(tokens) <= routed <= top_k * (sum(tokens) + tokens[3] + 1), (
            layer, routed, tokens,
        )  # fmt: skip


def _check_weights_split(info: dict, ranks: int) -> int:
    par = info["parallel"]
    assert par["world_size"] == ranks and len(par["ranks"]) == ranks
    sizes = [r["weight_bytes"] for r in par["ranks"]]
    assert len(set(sizes)) == 1
    return sizes[0]


def _build(folder: Path, config) -> str:
    import torch

    from tests.tiny_models import build_tokenizer, random_model

    if (folder / "config.json").is_file():
        return str(folder)
    torch.manual_seed(3)
    random_model(config).save_pretrained(folder)
    build_tokenizer(folder)
    return str(folder)


_SHAPE = dict(vocab_size=MODEL_VOCAB, num_hidden_layers=2, max_position_embeddings=1024,
              eos_token_id=2, pad_token_id=0, tie_word_embeddings=True)  # fmt: skip


def _odd_heads_model(root: Path) -> str:
    """Qwen2 (q/k/v bias, tied embeddings) with 6 heads over 2 KV heads: 3 heads per rank."""
    import transformers as tf

    config = tf.Qwen2Config(
        **_SHAPE,
        hidden_size=96,
        intermediate_size=128,
        num_attention_heads=6,
        num_key_value_heads=2,
    )
    return _build(root / "qwen2-6h", config)


def _tied_moe_model(root: Path) -> str:
    """Qwen3-MoE with tied embeddings; layer 0 dense, layer 1 sparse (on the second stage)."""
    import transformers as tf

    config = tf.Qwen3MoeConfig(
        **_SHAPE, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=2,
    )  # fmt: skip
    return _build(root / "qwen3-moe-tied", config)


def _server(path: str, **kwargs) -> Runtime:
    return Runtime(path, chunked_prefill_size=CHUNK, max_total_tokens=2048, **kwargs)


# --------------------------------------------------------------------------- dense
def test_tp2_dense_odd_heads_matches_one_rank(tmp_path_factory):
    path = _odd_heads_model(tmp_path_factory.mktemp("odd"))
    with _server(path, tp_size=2) as rt:
        _check_same_as_one_rank(rt.url, path)
        info = wait_idle_and_intact(rt.url)
        per_rank = _check_weights_split(info, 2)
        whole = rank_info(make_scheduler(path, max_total_tokens=2048).runner, 0)
        assert 0.45 < per_rank / whole["weight_bytes"] < 0.55, (per_rank, whole)
        kv = [r["kv_cache_bytes"] for r in info["parallel"]["ranks"]]
        assert kv == [whole["kv_cache_bytes"] // 2] * 2  # 1 of the 2 KV heads on each rank
        assert set(info["process_pids"]) == {"scheduler", "scheduler-rank1", "detokenizer"}


def test_tp4_replicated_kv_heads_and_a_killed_rank(tiny_model_dir):
    """llama with one KV head over 4 ranks (the KV head is replicated); then SIGKILL rank 3:
    the server exits 1 and says which rank died."""
    path = tiny_model_dir("llama-mqa")
    rt = _server(path, tp_size=4)
    try:
        _check_same_as_one_rank(rt.url, path)
        pid = server_info(rt.url)["process_pids"]["scheduler-rank3"]
        os.kill(pid, signal.SIGKILL)
        assert rt.process.wait(60) == 1  # event-driven; the bound only catches a hang
        log = Path(rt.log_path).read_text()
        assert "the scheduler-rank3 process died" in log, log[-3000:]
    finally:
        rt.shutdown()


def test_pp2_tied_moe_matches_one_rank(tmp_path_factory):
    """Two stages: the last stage's LM head is its own copy of the tied embedding, and the
    expert counts come from the stage that holds the sparse layer."""
    path = _tied_moe_model(tmp_path_factory.mktemp("pp"))
    with _server(path, pp_size=2) as rt:
        before = server_info(rt.url)["expert_token_counts"]
        got = _check_same_as_one_rank(rt.url, path)
        info = wait_idle_and_intact(rt.url)
        whole = rank_info(make_scheduler(path, max_total_tokens=2048).runner, 0)
        ranks = info["parallel"]["ranks"]
        assert [r["kv_cache_bytes"] for r in ranks] == [whole["kv_cache_bytes"] // 2] * 2
        assert all(r["weight_bytes"] < 0.75 * whole["weight_bytes"] for r in ranks)
        assert list(info["expert_token_counts"]) == ["1"]
        _check_expert_counts(before, info["expert_token_counts"], got)


def _llama_layers(root: Path, layers: int) -> str:
    """A tiny llama with `layers` layers (3 and 30 split unevenly over 2 and 4 stages)."""
    import transformers as tf

    config = tf.LlamaConfig(
        **{**_SHAPE, "num_hidden_layers": layers, "tie_word_embeddings": False},
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    return _build(root / f"llama-{layers}", config)


def test_default_layer_split_is_sglang_and_vllms():
    """vLLM's / SGLang's get_pp_indices split: the remainder one each to the stages counting
    back from the one before the last (which holds the LM head)."""
    from loom.runtime.distributed import ParallelState, pp_layer_partition, pp_layer_range

    assert pp_layer_partition(30, 4) == (7, 8, 8, 7)
    assert pp_layer_partition(30, 2) == (15, 15)
    assert pp_layer_partition(3, 2) == (2, 1)
    assert pp_layer_partition(3, 4) == (1, 1, 1, 0)
    assert pp_layer_partition(31, 4) == (8, 8, 8, 7)
    assert pp_layer_partition(3, 2, (0, 3)) == (0, 3)
    ranges = [pp_layer_range(30, ParallelState(pp_rank=r, pp_size=4)) for r in range(4)]
    assert ranges == [range(0, 7), range(7, 15), range(15, 23), range(23, 30)]
    assert pp_layer_range(5) == range(0, 5)  # one stage holds every layer


PP_UNEVEN = [(3, 2, None), (3, 4, None), (30, 2, None), (30, 4, None), (3, 2, "0,3")]


@pytest.mark.parametrize(
    "layers, pp, partition",
    PP_UNEVEN,
    ids=[f"L{n}-pp{p}-{q or 'default'}" for n, p, q in PP_UNEVEN],
)
def test_pp_uneven_layers_match_one_rank(tmp_path_factory, layers, pp, partition):
    """Layer counts pp_size does not divide (and explicit partitions, one with an empty first
    stage): greedy outputs and prompt logprobs equal to one rank's, and each stage holds the
    KV of its own layers only."""
    from loom.runtime.distributed import pp_layer_partition

    path = _llama_layers(tmp_path_factory.mktemp("ppu"), layers)
    extra = {"pp_layer_partition": partition} if partition else {}
    with _server(path, pp_size=pp, **extra) as rt:
        _check_same_as_one_rank(rt.url, path)
        info = wait_idle_and_intact(rt.url)
        whole = rank_info(make_scheduler(path, max_total_tokens=2048).runner, 0)
        explicit = tuple(map(int, partition.split(","))) if partition else None
        counts = pp_layer_partition(layers, pp, explicit)
        kv = [r["kv_cache_bytes"] for r in info["parallel"]["ranks"]]
        assert kv == [whole["kv_cache_bytes"] * c // layers for c in counts]


# --------------------------------------------------------------------------- MoE
# EP = TP x DP (dp_size 1): with tp_size 2 and ep_size 2 each rank holds half the experts whole
# and half the attention heads; ep_size 2 alone replicates attention. Each MoE family runs both
# EP layouts, with both ways to combine the experts (all-reduce, the default, and all-to-all).
A2A = {"moe_a2a_backend": "all_to_all"}
MOE_LAYOUTS = [
    ("qwen2-moe", {"tp_size": 2}),  # every expert's intermediate split: all-reduce
    ("qwen2-moe", {"ep_size": 2, **A2A}),
    ("qwen2-moe", {"tp_size": 2, "ep_size": 2}),
    ("qwen3-moe", {"ep_size": 2}),
    ("qwen3-moe", {"tp_size": 2, "ep_size": 2, **A2A}),
    ("mixtral", {"ep_size": 2}),
]  # Mixtral's TP2+EP2 (all-to-all) runs as two nodes below


@pytest.mark.parametrize(
    "family, layout",
    MOE_LAYOUTS,
    ids=[f"{f}-" + "-".join(f"{k}={v}" for k, v in lay.items()) for f, lay in MOE_LAYOUTS],
)
def test_moe_layouts_match_one_rank(tiny_model_dir, family, layout):
    path = tiny_model_dir(family)
    with _server(path, enable_metrics=True, **layout) as rt:
        before = server_info(rt.url)["expert_token_counts"]
        got = _check_same_as_one_rank(rt.url, path)
        info = wait_idle_and_intact(rt.url)
        _check_weights_split(info, 2)
        counts = info["expert_token_counts"]
        assert counts and all(len(c) == 4 for c in counts.values())
        _check_expert_counts(before, counts, got)
        metrics = requests.get(rt.url + "/metrics", timeout=30).text
        layer, per_expert = next(iter(counts.items()))
        line = rf'loom:moe_expert_tokens{{expert="1",layer="{layer}",.*}} {float(per_expert[1])}'
        assert re.search(line, metrics), metrics


def test_two_nodes_on_localhost_serve_a_request(tiny_model_dir):
    """Mixtral TP2+EP2 (all-to-all) as 2 "nodes": node 1 runs rank 1 only, node 0 serves HTTP."""
    path = tiny_model_dir("mixtral")
    addr = f"127.0.0.1:{free_port()}"
    common = dict(tp_size=2, ep_size=2, nnodes=2, dist_init_addr=addr, **A2A)
    node1 = ServerArgs(model_path=path, node_rank=1, max_total_tokens=2048, **common)
    cmd = [sys.executable, "-m", "loom.launch_server", *server_argv(node1)]
    other = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        with _server(path, **common) as rt:
            before = server_info(rt.url)["expert_token_counts"]
            got = _check_same_as_one_rank(rt.url, path)
            info = wait_idle_and_intact(rt.url)
            _check_expert_counts(before, info["expert_token_counts"], got)
            assert set(info["process_pids"]) == {"scheduler", "detokenizer"}
        assert other.wait(30) == 1  # its rank lost rank 0: node 1 goes down too
    finally:
        if other.poll() is None:
            other.kill()
        other.wait()


# --------------------------------------------------------------------------- layouts
def test_impossible_layouts_are_refused_by_name(tiny_model_dir):
    import loom

    for kwargs, message in [
        ({"tp_size": 8}, "tp_size: 8 does not divide num_attention_heads (4)"),
        ({"tp_size": 3}, "tp_size: 3 does not divide num_attention_heads"),
        ({"ep_size": 2}, "ep_size: 2 needs a mixture-of-experts model"),
        ({"pp_size": 2, "pp_layer_partition": "1,2"}, "pp_layer_partition: 1,2 sums to 3"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            loom.Engine(tiny_model_dir("llama"), **kwargs)
    with pytest.raises(ValueError, match="ep_size: 3 does not divide the number of experts"):
        loom.Engine(tiny_model_dir("mixtral"), ep_size=3)
    for kwargs, message in [
        ({"tp_size": 4, "ep_size": 3}, "ep_size: 3 must divide tp_size"),
        ({"nnodes": 2, "tp_size": 2}, "dist_init_addr: is required"),
        ({"nnodes": 2, "tp_size": 3, "dist_init_addr": "h:1"}, "nnodes: 2 nodes cannot hold 3"),
        ({"node_rank": 1}, "node_rank: must be in"),
        ({"pp_size": 2, "tp_size": 2}, "pp_size: 2 with tp_size or ep_size > 1 is not supported"),
        ({"dist_init_addr": "nohost"}, "dist_init_addr: must be host:port"),
        ({"pp_max_micro_batch_size": 2}, "pp_max_micro_batch_size: needs pp_size > 1"),
        ({"pp_size": 2, "pp_max_micro_batch_size": 0}, "pp_max_micro_batch_size: must be >= 1"),
        ({"pp_size": 2, "pp_layer_partition": "2,x"}, "pp_layer_partition: must be comma-sep"),
        ({"pp_size": 2, "pp_layer_partition": "1,1,1"}, "pp_layer_partition: has 3 stages"),
        ({"ep_size": 2, "moe_a2a_backend": "deepep"}, "moe_a2a_backend: must be one of"),
        ({"ep_size": 2, "moe_a2a_backend": "auto"}, "moe_a2a_backend: must be one of"),
        (
            {"tp_size": 4, "ep_size": 2, "moe_a2a_backend": "all_to_all"},
            "moe_a2a_backend: all_to_all needs",
        ),
        ({"moe_a2a_backend": "all_to_all"}, "moe_a2a_backend: all_to_all needs ep_size > 1"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            ServerArgs(**kwargs)
    assert not ServerArgs(ep_size=2).moe_all_to_all  # SGLang's default: all-reduce
    assert ServerArgs(tp_size=2, ep_size=2, moe_a2a_backend="all_to_all").moe_all_to_all


def test_layout_warnings(tiny_model_dir, caplog, monkeypatch):
    """TP across nodes and more ranks than cores are allowed, with a warning."""
    from loom.runtime import distributed
    from loom.runtime.model_loader import load_config

    path = tiny_model_dir("llama")
    config = load_config(path)
    monkeypatch.setattr(distributed.os, "cpu_count", lambda: 2)
    two_nodes = dict(nnodes=2, dist_init_addr="127.0.0.1:1")
    distributed.check_layout(
        ServerArgs(model_path=path, tp_size=4, device="cpu", **two_nodes), config
    )
    assert "tp_size 4 spans 2 nodes" in caplog.text
    assert "ranks on 2 CPU cores" not in caplog.text  # 2 ranks on each node
    caplog.clear()
    distributed.check_layout(ServerArgs(model_path=path, tp_size=2, device="cpu"), config)
    assert caplog.text == ""
    distributed.check_layout(ServerArgs(model_path=path, tp_size=4, device="cpu"), config)
    assert "4 ranks on 2 CPU cores" in caplog.text


def _peer_fails_on_lost_connection(owner_pid, ready_pipe):
    ready_pipe.send({"error": "scheduler failed to start: connection closed by peer"})


def _rank_fails(owner_pid, ready_pipe):
    time.sleep(0.3)  # its peer's error arrives first
    ready_pipe.send({"error": "rank 1 failed to start: out of memory"})


def test_a_rank_failing_at_start_up_is_reported():
    """A rank's own start-up error is reported, not only its peer's lost connection."""
    from loom.runtime import process

    started = [
        process.start_process(_peer_fails_on_lost_connection, (), "scheduler"),
        process.start_process(_rank_fails, (), "scheduler-rank1"),
    ]
    try:
        with pytest.raises(RuntimeError, match="rank 1 failed to start: out of memory"):
            process.wait_all_ready(started, 60)
    finally:
        for proc, _ in started:
            proc.join(10)
        process.stop_fork_server_if_idle()
