#!/usr/bin/env bash
# The one prepared GPU check of issue 19 (under 8 minutes on one H200):
#   1. the kernel tests on CUDA (compiled Triton kernels against their torch references, the
#      W4A16 / W8A16 GEMM (kernels/wq_gemm.py) included, and
#      --attention-backend triton end to end against the torch backend);
#   2. a Qwen2.5-0.5B-shaped model (random weights, bfloat16): decode tok/s at batch 1/16/64
#      for loom with the triton backend and CUDA graphs (runtime/graph_runner.py), the same
#      with --disable-cuda-graph, loom with the torch backend (never captured), and HF
#      `generate`; prefill tok/s; greedy agreement (graphs on vs off, triton vs torch); decode
#      attention alone (the Triton kernel vs the torch backend's gather + SDPA, batch 64 x
#      context 1024). Writes the markdown table the docs print (default
#      docs/img/kernels_gpu_check.md).
#
#   scripts/gpu_check.sh [--dry-run] [--out FILE]
# --dry-run: the same code on the CPU with tiny shapes through Triton's interpreter (no kernel
# tests: CI runs them); the graphs-on row runs the graph runner in eager-replay mode (its static
# buffers and padding, batch 3 padded to 4, no capture: the CPU has no graphs);
# tests/test_gpu_check.py runs it so the script cannot rot.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=full
out=docs/img/kernels_gpu_check.md
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) mode=dry ;;
        --out) out="$2"; shift ;;
        *) echo "usage: $0 [--dry-run] [--out FILE]" >&2; exit 2 ;;
    esac
    shift
done

if [ "$mode" = full ]; then
    python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: no CUDA device (use --dry-run on the CPU)')"
    timeout 240 python -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_kernels_backend.py tests/test_kernels_wq.py
fi

PYTHONPATH=. timeout 420 python - "$mode" "$out" <<'PY'
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers as tf

from tests.runtime_helpers import make_scheduler, run_all, submit
from tests.tiny_models import build_tiny_model, build_tokenizer, random_model

mode, out = sys.argv[1], Path(sys.argv[2])
dry = mode == "dry"
if dry:
    from loom.kernels.interpret import load_interpreted

    load_interpreted("decode_attention")  # the backend's kernels, through the interpreter
    os.environ["TRITON_INTERPRET"] = "1"  # this process only: ServerArgs admits triton on CPU
device = "cpu" if dry else "cuda"
dtype = "float32" if dry else "bfloat16"
BATCHES = [1, 3] if dry else [1, 16, 64]  # dry: 3 pads to the graph size 4
NEW = 2 if dry else 64  # decode tokens per request
PROMPT = 8 if dry else 16
PREFILL = (2, 12) if dry else (8, 512)  # requests x tokens

work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
if dry:
    path = build_tiny_model("llama", work / "model")
    label = "tiny llama (2 layers, hidden 64), float32, CPU, Triton interpreter"
else:
    config = tf.Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    path = work / "model"
    random_model(config).to(torch.bfloat16).save_pretrained(path)
    build_tokenizer(path)
    label = f"Qwen2.5-0.5B shape, random weights, bfloat16, {torch.cuda.get_device_name()}"
vocab = tf.AutoConfig.from_pretrained(path).vocab_size
gen = torch.Generator().manual_seed(0)


def prompts(n, length):
    return [torch.randint(3, min(vocab, 300), (length,), generator=gen).tolist() for _ in range(n)]


def sync():
    if device == "cuda":
        torch.cuda.synchronize()


RUNS = iter(range(10**6))
GRAPH_STEPS = {"decode": 0, "graph": 0}


def loom_run(sched, ids_list, new):
    """Wall seconds to serve `ids_list` greedily to `new` tokens each; their outputs."""
    tag = next(RUNS)
    params = {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}
    for i, ids in enumerate(ids_list):
        submit(sched, f"{tag}-{i}", ids, params)
    sync()
    t0 = time.perf_counter()
    res = run_all(sched)
    sync()
    return time.perf_counter() - t0, [res[f"{tag}-{i}"].ids for i in range(len(ids_list))]


def loom_rows(backend, graphs=False):
    sched = make_scheduler(str(path), attention_backend=backend, dtype=dtype, device=device,
                           max_total_tokens=64 * (PROMPT + NEW + 8) + PREFILL[0] * PREFILL[1] + 64,
                           max_running_requests=64, disable_cuda_graph=not graphs,
                           # dry: short rows keep the graph's fixed split count at 1 (the
                           # interpreter's cost grows with it; the kernel tests cover splits)
                           context_length=64 if dry else None)
    sched.check_integrity_every_step = False
    runner = sched.runner
    if graphs and dry:  # the CPU never captures: the same buffers and padding, run eagerly
        from loom.kernels.cuda_graph import capture_batch_sizes
        from loom.runtime.graph_runner import GraphRunner

        runner.graph_runner = GraphRunner(runner, capture_batch_sizes(4), capture=False)
    assert (runner.graph_runner is not None) == graphs, "CUDA graphs were not captured"
    if graphs:  # count the decode steps, and those that went through the graph buffers
        gr, run, can_run = runner.graph_runner, runner.graph_runner.run, runner.graph_runner.can_run

        def counted_can_run(batch):
            GRAPH_STEPS["decode"] += batch.mode.is_decode
            return can_run(batch)

        def counted_run(batch):
            GRAPH_STEPS["graph"] += 1
            return run(batch)

        gr.can_run, gr.run = counted_can_run, counted_run
    loom_run(sched, prompts(2, PROMPT), 2)  # warm-up: kernel compilation, allocator
    decode = {}
    for b in BATCHES:  # fresh prompts each run, so nothing comes from the radix cache
        t1, _ = loom_run(sched, prompts(b, PROMPT), 1)
        tn, _ = loom_run(sched, prompts(b, PROMPT), 1 + NEW)
        decode[b] = b * NEW / max(tn - t1, 1e-9)
    n, length = PREFILL
    tp, _ = loom_run(sched, prompts(n, length), 1)
    gen.manual_seed(1)  # the same greedy batch for both backends
    _, outs = loom_run(sched, prompts(max(BATCHES), PROMPT), NEW)
    return decode, n * length / tp, outs


def hf_rows():
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device)
    model.eval()

    def run(b, length, new):
        ids = torch.tensor(prompts(b, length), device=device)
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, pad_token_id=0)
        sync()
        return time.perf_counter() - t0

    run(2, PROMPT, 2)
    decode = {}
    for b in BATCHES:
        t1 = run(b, PROMPT, 1)
        decode[b] = b * NEW / max(run(b, PROMPT, 1 + NEW) - t1, 1e-9)
    n, length = PREFILL
    return decode, n * length / run(n, length, 1)


def attention_micro():
    """Decode attention alone, one layer: the Triton kernel (KV read in place) vs the torch
    backend's gather + SDPA, at the largest batch over a long context; median microseconds."""
    from types import SimpleNamespace

    from loom.kernels import decode_attention as dk
    from loom.runtime.attention.torch_backend import _decode

    b, ctx, h, hkv, d = (2, 40, 4, 2, 16) if dry else (64, 1024, 14, 2, 64)
    half = torch.float32 if dry else torch.bfloat16
    k_buf = torch.randn(b * ctx + 1, hkv, d, device=device).to(half)
    v_buf = torch.randn(b * ctx + 1, hkv, d, device=device).to(half)
    table = (1 + torch.randperm(b * ctx, device=device)).view(b, ctx)
    rows, seq = torch.arange(b, device=device), torch.full((b,), ctx, device=device)
    q = torch.randn(b, h, d, device=device).to(half)
    mask = torch.ones(b, 1, 1, ctx, dtype=torch.bool, device=device)
    layer = SimpleNamespace(scaling=d**-0.5, is_gqa=h != hkv)
    splits = dk.num_splits_for(ctx)

    def triton_step():
        return dk.decode_attention(q, k_buf, v_buf, table, rows, seq, d**-0.5, num_splits=splits)[0]

    def torch_step():
        return _decode(q, k_buf, v_buf, table.reshape(-1), mask, layer)

    err = (triton_step().float() - torch_step().float()).abs().max().item()
    times = {}
    for name, fn in (("triton", triton_step), ("torch", torch_step)):
        samples = []
        for _ in range(3 if dry else 50):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            samples.append(time.perf_counter() - t0)
        times[name] = sorted(samples)[len(samples) // 2] * 1e6
    return b, ctx, times, err


micro = attention_micro()
GRAPHS = "loom, triton backend, CUDA graphs" + (" (eager replay)" if dry else "")
rows = {
    GRAPHS: loom_rows("triton", graphs=True),
    "loom, triton backend": loom_rows("triton"),
    "loom, torch backend": loom_rows("torch"),
}
same = sum(a == b for a, b in zip(rows["loom, triton backend"][2], rows["loom, torch backend"][2]))
same_graphs = sum(a == b for a, b in zip(rows[GRAPHS][2], rows["loom, triton backend"][2]))
rows["HF generate"] = (*hf_rows(), None)

lines = [
    f"Machine: {label}. torch {torch.__version__}; load {os.getloadavg()[0]:.1f};"
    f" {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
    f"Decode: {PROMPT}-token prompts, {NEW} greedy tokens per request (tok/s over the decode"
    f" steps only); prefill: {PREFILL[0]} prompts x {PREFILL[1]} tokens. CUDA graphs: decode"
    " batches up to 64 (sizes 1, 2, 4, 8, then every 8), triton backend only"
    + (" (dry run: the graph runner's buffers and padding, run eagerly)." if dry else "."),
    "",
    "| | " + " | ".join(f"decode batch {b}" for b in BATCHES) + " | prefill |",
    "|---" * (len(BATCHES) + 2) + "|",
]


def rate(x):  # two significant digits below 10 (the dry run's interpreter rates)
    return f"{x:,.0f}" if x >= 10 else f"{x:.2g}"


for name, (decode, prefill, _) in rows.items():
    cells = " | ".join(rate(decode[b]) for b in BATCHES)
    lines.append(f"| {name} tok/s | {cells} | {rate(prefill)} |")
on, off = rows[GRAPHS][0], rows["loom, triton backend"][0]
lines += ["", "CUDA graphs on / off, decode tok/s (triton backend): "
          + ", ".join(f"batch {b} {on[b] / off[b]:.2f}x" for b in BATCHES) + "."]  # fmt: skip
mb, mctx, mt, merr = micro
lines += ["", f"Decode attention alone, one layer, batch {mb} x context {mctx}: Triton kernel"
          f" {mt['triton']:,.0f} us, torch backend (gather + SDPA) {mt['torch']:,.0f} us"
          f" (median; max abs difference {merr:.1e})."]  # fmt: skip
lines += ["", f"Greedy outputs equal between the triton and torch backends: {same} of"
          f" {max(BATCHES)} requests ({NEW} tokens each); with CUDA graphs on and off (triton):"
          f" {same_graphs} of {max(BATCHES)}. Decode steps through the graph runner:"
          f" {GRAPH_STEPS['graph']} of {GRAPH_STEPS['decode']}."]  # fmt: skip
out.parent.mkdir(parents=True, exist_ok=True)
out.write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY
