"""Parallel workers: throughput and per-rank memory of TP=1 vs TP=2 and PP=2 (dense) and EP=1
vs EP=2 (MoE), each layout a live Engine, the runs alternating (TP1, TP2, PP2, ..., EP2, ...).
Also PP=2 with micro-batches (the default: each step's requests in pp_size groups, so the
stages overlap) against PP=2 in one piece (--pp-max-micro-batch-size = all requests), and
EP=2 with all-to-all dispatch against the default all-reduce (--moe-a2a-backend none).

Workload: --num-requests greedy requests (prompts of --prompt-len random tokens, --new-tokens
each, ignore_eos) sent as one batch; tok/s counts prompt + new tokens over the wall time.
Printed as ratios (TP2 / TP1, PP2 / TP1, EP2 / EP1, PP2 / PP2-1mb, EP2-a2a / EP2:
median of per-round ratios with the range) beside the
per-rank weight and KV bytes from get_server_info. On a 2-core CPU the speed ratio is
informative only: two ranks share two cores with everything else, so a ratio below 1 there
says nothing about a GPU; the memory split is exact anywhere.

Models: dense --model (default: the bundled Qwen3, 4 heads / 2 KV heads); MoE: a random
Qwen3-MoE (hidden 256, 4 layers, 8 experts top-2, 4 heads / 2 KV heads, bundled tokenizer)
built once into the benchmark model cache.

    python benchmarks/bench_parallel.py [--model bundled|PATH] [--rounds 3]
        [--num-requests 16] [--prompt-len 128] [--new-tokens 32] [--device cpu|cuda]
        [--layouts TP1,TP2,PP2,PP2-1mb,EP1,EP2,EP2-a2a]
"""

from __future__ import annotations

import argparse
import random
import shutil
import time
from pathlib import Path

import common


def moe_model_path() -> str:
    import torch
    import transformers

    from loom.runtime.server_args import BUNDLED_MODEL_PATH

    path = common.MODEL_CACHE / "qwen3-moe-small"
    if (path / "model.safetensors").exists():
        return str(path)
    bundled = Path(BUNDLED_MODEL_PATH)
    tok = transformers.AutoTokenizer.from_pretrained(bundled)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=len(tok), hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=4096,
        bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bundled / f, tmp / f)
    tmp.rename(path)
    return str(path)


def _probe_rank(rank: int, addr: str, requests: int, cost: float, rounds: int, out) -> None:
    """One stage of a 2-stage pipeline whose layers sleep `cost` s per token (no CPU used), run
    through the real PipelineStage.forward: one piece vs the default micro-batches."""
    import types

    import torch
    import torch.distributed as dist

    from loom.runtime.distributed import ParallelState, set_parallel_state
    from loom.runtime.forward_batch import ForwardBatch, ForwardMode, forward_context
    from loom.runtime.layers.pipeline import PipelineStage

    dist.init_process_group("gloo", init_method=f"tcp://{addr}", world_size=2, rank=rank)
    backend = types.SimpleNamespace(init_forward_metadata=lambda batch: None)
    ids = torch.zeros(requests, dtype=torch.int64)
    batch = ForwardBatch(
        ForwardMode.DECODE, ids, ids, ids, torch.arange(requests), ids + 1, [1] * requests,
        [0] * requests, None, None, backend, torch.arange(requests),
    )  # fmt: skip
    result = {}
    for label, per in (("one piece", requests), ("micro-batched", None)):
        set_parallel_state(ParallelState(rank=rank, world_size=2, pp_rank=rank, pp_size=2,
                                         pp_max_micro_batch_size=per))  # fmt: skip
        stage = PipelineStage(types.SimpleNamespace(num_hidden_layers=2, vocab_size=8))

        def model(input_ids, positions, stage=stage):
            if stage.is_first:
                time.sleep(cost * len(input_ids))
                h = torch.zeros(len(input_ids), 16)
                stage.send(h, h)
                return None
            h, _ = stage.recv(len(input_ids), 16, torch.float32, "cpu")
            time.sleep(cost * len(input_ids))
            return h

        times = []
        for _ in range(rounds):
            dist.barrier()
            start = time.perf_counter()
            with forward_context(batch):
                stage.forward(model, ids, ids)
            dist.barrier()  # the step ends when the last stage is done
            times.append(time.perf_counter() - start)
        result[label] = times
    if rank == 0:
        out.put(result)
    dist.destroy_process_group()


def pp_overlap_probe(requests: int = 8, cost: float = 0.025, rounds: int = 3) -> dict:
    """Step seconds of a 2-stage pipeline with sleeping layers: one piece costs the sum of the
    stages (2 x requests x cost); two micro-batches 1.5 x if the stages really overlap."""
    import torch.multiprocessing as mp

    from loom.runtime.distributed import free_local_addr

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    addr = free_local_addr()
    procs = [
        ctx.Process(target=_probe_rank, args=(r, addr, requests, cost, rounds, out))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    result = out.get(timeout=300)
    for p in procs:
        p.join(60)
    return result


def run_once(engine, prompts: list[list[int]], new_tokens: int) -> float:
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    out = engine.generate(input_ids=prompts, sampling_params=params)
    elapsed = time.perf_counter() - start
    assert all(len(o["output_ids"]) == new_tokens for o in out)
    return elapsed


def main() -> None:
    import loom

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bundled")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--device", default=None)
    ap.add_argument("--layouts", default=None, help="comma-separated subset (default: all)")
    args = ap.parse_args()

    probe = pp_overlap_probe()
    label, dense = common.resolve_model(args.model)
    moe = moe_model_path()
    rng = random.Random(0)
    prompts = [
        [rng.randrange(10, 4000) for _ in range(args.prompt_len)] for _ in range(args.num_requests)
    ]
    layouts = {
        "TP1": (dense, {}),
        "TP2": (dense, {"tp_size": 2}),
        "PP2": (dense, {"pp_size": 2}),
        "PP2-1mb": (dense, {"pp_size": 2, "pp_max_micro_batch_size": args.num_requests}),
        "EP1": (moe, {}),
        "EP2": (moe, {"ep_size": 2}),  # the default combine: all-reduce
        "EP2-a2a": (moe, {"ep_size": 2, "moe_a2a_backend": "all_to_all"}),
    }
    if args.layouts:
        layouts = {k: v for k, v in layouts.items() if k in args.layouts.split(",")}
    common_kw = dict(max_total_tokens=8192, disable_radix_cache=True)  # every round computes
    if args.device:
        common_kw["device"] = args.device
    engines = {}
    try:
        for name, (path, kw) in layouts.items():
            engines[name] = loom.Engine(path, **common_kw, **kw)
            run_once(engines[name], prompts[:2], 2)  # warm-up
        runs = {
            name: (lambda e=e: run_once(e, prompts, args.new_tokens)) for name, e in engines.items()
        }
        times = common.alternate(runs, args.rounds)
        memory = {name: e.get_server_info()["parallel"]["ranks"] for name, e in engines.items()}
    finally:
        for e in engines.values():
            e.shutdown()

    tokens = args.num_requests * (args.prompt_len + args.new_tokens)
    print(common.header("bench_parallel"))
    print(
        f"dense model {label}, MoE model qwen3-moe-small; {args.num_requests} requests x "
        f"({args.prompt_len} prompt + {args.new_tokens} new) tokens, greedy, radix cache off"
    )
    print("| layout | median tok/s | ranks | weight MiB per rank | KV MiB per rank |")
    print("|---|---|---|---|---|")
    for name, ts in times.items():
        ranks = memory[name]
        w = "/".join(f"{r['weight_bytes'] / 2**20:.2f}" for r in ranks)
        kv = "/".join(f"{r['kv_cache_bytes'] / 2**20:.1f}" for r in ranks)
        tps = tokens / sorted(ts)[len(ts) // 2]
        print(f"| {name} | {tps:.0f} | {len(ranks)} | {w} | {kv} |")
    # throughput ratio = time ratio inverted: per round, t(den) / t(num)
    pairs = [
        ("TP2", "TP1", "TP2 / TP1"),
        ("PP2", "TP1", "PP2 / TP1"),
        ("EP2", "EP1", "EP2 / EP1"),
        ("PP2", "PP2-1mb", "PP2 micro-batched / PP2 in one piece"),
        ("EP2-a2a", "EP2", "EP2 all-to-all / EP2 all-reduce"),
    ]
    for a, b, label in pairs:
        if a in times and b in times:
            print(f"{label} throughput: {common.fmt_ratio(times[b], times[a])}")
    for a, b, _ in pairs[:3]:
        if a in memory and b in memory:
            ratio = memory[a][0]["weight_bytes"] / memory[b][0]["weight_bytes"]
            print(f"{a} / {b} weight bytes per rank: {ratio:.3f}")
    one, micro = (sorted(probe[k])[len(probe[k]) // 2] for k in ("one piece", "micro-batched"))
    print(
        f"PP2 overlap probe (layers sleep 25 ms per token, 8 requests, real PipelineStage): "
        f"one piece {one * 1e3:.0f} ms per step (stages in turn: 400), micro-batched "
        f"{micro * 1e3:.0f} ms (full overlap of 2 micro-batches: 300); ratio {micro / one:.2f}"
    )
    print(common.loadavg())


if __name__ == "__main__":
    main()
