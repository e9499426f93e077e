"""The compact L2 (`--hicache-l2-dtype bf16|int8`, radix/pages.py PageCodec): what it holds and
what it changes. Per L2 form: tokens per GiB of host memory (the server's L2 capacity for
--hicache-size 1), and, against the hierarchy off, greedy outputs of requests whose prefix
came back from L2: requests identical, output tokens agreeing (position by position up to
each request's first difference) and the logprob drift of the chosen tokens before it (mean
and max |logprob - reference|).

Workload: --tenants text prefixes of --prefix tokens (records from bench_cag's knowledge
base), three rounds, one request at a time, each the tenant's prefix + a question; the KV pool
holds one tenant, L2 all of them, so rounds 2 and 3 load every prefix from L2. The engines
run one after the other (accuracy, not speed, is measured).

    python benchmarks/bench_hicache_l2.py [--model PATH] [--tenants 3] [--prefix 192]
        [--new-tokens 12]
"""

from __future__ import annotations

import argparse
import statistics

import bench_cag
import common


def run(engine, prompts: list[list[int]], new_tokens: int) -> list[dict]:
    sp = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    out = []
    for p in prompts:
        o = engine.generate(input_ids=p, sampling_params=sp, return_logprob=True)
        lps = [t[0] for t in o["meta_info"]["output_token_logprobs"]]
        out.append({"ids": o["output_ids"], "lps": lps, "cached": o["meta_info"]["cached_tokens"]})
    return out


def compare(ref: list[dict], got: list[dict]) -> dict:
    same = agree = total = 0
    drift: list[float] = []
    for r, g in zip(ref, got):
        same += r["ids"] == g["ids"]
        total += len(r["ids"])
        for a, b, la, lb in zip(r["ids"], g["ids"], r["lps"], g["lps"]):
            if a != b:
                break
            agree += 1
            drift.append(abs(la - lb))
    return {
        "identical": f"{same}/{len(ref)}",
        "agree": agree / total,
        "drift_mean": statistics.mean(drift) if drift else float("nan"),
        "drift_max": max(drift) if drift else float("nan"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model", default=str(bench_cag.SMOLLM2) if bench_cag.SMOLLM2.exists() else None
    )
    ap.add_argument("--tenants", type=int, default=3)
    ap.add_argument("--prefix", type=int, default=192)
    ap.add_argument("--new-tokens", type=int, default=12)
    args = ap.parse_args()

    from loom.runtime.engine import Engine
    from loom.runtime.tokenizer import load_tokenizer

    label, path = common.resolve_model(args.model)
    tok = load_tokenizer(path)
    kb = bench_cag.knowledge_base(12 * args.tenants, seed=3)
    heads = []
    for t in range(args.tenants):
        text = "".join(r[0] for r in kb[12 * t : 12 * (t + 1)])
        heads.append(tok.encode(text)[: args.prefix])
    assert all(len(h) == args.prefix for h in heads), "records too short for --prefix"
    prompts = []
    for rnd in range(3):
        for t in range(args.tenants):
            person = kb[12 * t + 4 * rnd][1]
            prompts.append(heads[t] + tok.encode(bench_cag.question(person)))
    pool = args.prefix + 64  # one tenant
    base = dict(max_total_tokens=pool, dtype="float32", context_length=4096)
    print(common.header(f"bench_hicache_l2: {label}"))
    print(f"{args.tenants} tenants x {args.prefix}-token prefixes, 3 rounds, KV pool {pool} "
          f"tokens, {args.new_tokens} greedy tokens per request")  # fmt: skip
    with Engine(path, **base) as e:
        ref = run(e, prompts, args.new_tokens)
    later = slice(args.tenants, None)  # rounds 2 and 3: prefixes from L2
    print("| L2 form | tokens / GiB of L2 | L2 hit tokens | requests identical | tokens "
          "agreeing | logprob drift mean | max |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for form in ("exact", "bf16", "int8"):
        hi = dict(base, enable_hierarchical_cache=True, hicache_size=1, hicache_l2_dtype=form)
        with Engine(path, **hi) as e:  # 1 GB of L2: every tenant fits in each form
            got = run(e, prompts, args.new_tokens)
            info = e.get_server_info()
            per_gib = info["hicache_l2_capacity_tokens"] * 2**30 / 1e9
            hits = info["hicache_l2_hit_tokens"]
        c = compare(ref[later], got[later])
        print(f"| {form} | {per_gib:,.0f} | {hits} | {c['identical']} | {c['agree']:.1%} "
              f"| {c['drift_mean']:.2e} | {c['drift_max']:.2e} |")  # fmt: skip
    print(f"end: {common.loadavg()}")


if __name__ == "__main__":
    main()
