"""Offline throughput: loom's Engine beside HF transformers `generate` on the same requests.

Offline workload: N requests (default 64), prompts of 10-400 tokens, 8-128 new tokens each
(greedy, ignore_eos). HF runs them once as one padded static batch (which must run to the
longest output) and once one request at a time. Both sides are warmed up first; the runs
alternate (loom, HF static, HF serial, loom, ...) for --rounds rounds and the ratios are the
median of the per-round ratios with their range. Useful tokens/s counts only each request's
own new tokens. Decode overhead = the share of all decode-step time (every batch size) spent
outside the model forward.

Batched workload (--batched): B sequences of --pp random prompt tokens and --tg new tokens for
each B in --batch-sizes, as llama.cpp's llama-batched-bench measures it: prefill tok/s =
B*pp / (time until every sequence has its first token), decode tok/s = B*(tg-1) / (the rest),
both from one timed run per side and round (loom streams the batch and notes when the last
sequence's first token arrives; HF's generate notes it through a streamer). Writes
docs/img/throughput_{decode,prefill}_<model>.png (tok/s against batch size, every side).

--llamacpp adds llama.cpp (benchmarks/peers/llamacpp.py; run_all.py passes it when llama.cpp is
built): its tokenization and greedy tokens are checked against loom's first, then llama-server
(offline) and llama-batched-bench (batch sweep), llama.cpp's default -fa auto and -fa off, are
more sides in the same alternation, so every round runs loom, HF and llama.cpp back to back;
each ratio against them is the median of per-round ratios with its range, as HF's is. Each
comparison crosses the same boundary on both sides: llama-server (with llama.cpp's default
per-slot KV, and with --kv-unified, both rows) meets a loom server sent the same requests by
the same HTTP client; llama-batched-bench (an in-process loop) meets the in-process Engine;
HF's in-process `generate` meets the Engine.

    python benchmarks/bench_offline.py [--model bundled|qwen0.5b-f32|qwen0.5b-bf16|PATH]
        [--num-requests 64] [--rounds 3] [--batched --batch-sizes 1,8,32,64 --pp 128 --tg 32]
        [--llamacpp]
"""

from __future__ import annotations

import argparse
import queue
import random
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import common


def make_requests(tokenizer, n: int, seed: int, max_prompt: int = 400, max_new: int = 128):
    rng = random.Random(seed)
    words = sorted(w for w in tokenizer.get_vocab() if w.isalpha() and len(w) > 2)[:2000] or ["the"]
    reqs = []
    for _ in range(n):
        target = rng.randint(min(10, max_prompt), max_prompt)
        ids: list[int] = []
        while len(ids) < target:
            ids += tokenizer.encode(" " + rng.choice(words))
        reqs.append((ids[:target], rng.randint(min(8, max_new), max_new)))
    return reqs


STALL_S = 600  # a streamed batch that sends nothing for this long has hung (seen once)


def _stall_guard(items, seconds: float):
    """Yield from an iterator, raising TimeoutError when it yields nothing for `seconds`: a
    benchmark must fail, not hang (one of loom's streams once sent nothing, every process idle).
    In the main thread an interval timer (SIGALRM) watches each wait, so a streamed token costs
    the timed side no extra thread hop; elsewhere a pump thread and a queue do."""
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
        yield from _alarm_guard(items, seconds)
    else:
        yield from _thread_guard(items, seconds)


def _alarm_guard(items, seconds: float):
    def stalled(signum, frame):
        raise TimeoutError(f"loom's stream sent nothing for {seconds} s")

    previous = signal.signal(signal.SIGALRM, stalled)
    try:
        it = iter(items)
        while True:
            signal.setitimer(signal.ITIMER_REAL, seconds)
            try:
                item = next(it)
            except StopIteration:
                return
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            yield item
    finally:
        signal.signal(signal.SIGALRM, previous)


def _thread_guard(items, seconds: float):
    q: queue.Queue = queue.Queue()
    end = object()

    def pump() -> None:
        try:
            for item in items:
                q.put(item)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            q.put(e)
        q.put(end)

    threading.Thread(target=pump, daemon=True).start()
    while True:
        try:
            item = q.get(timeout=seconds)
        except queue.Empty:
            raise TimeoutError(f"loom's stream sent nothing for {seconds} s") from None
        if item is end:
            return
        if isinstance(item, BaseException):
            raise item
        yield item


class LoomSide:
    """One Engine kept for every round (warmed up once); the cache is flushed before each run."""

    def __init__(self, model_path: str, max_running: int, threads: int):
        import loom

        self.engine = loom.Engine(
            model_path,
            max_running_requests=max_running,
            random_seed=0,
            cpu_threads=threads,
            log_level="warning",
        )
        self.engine.generate(input_ids=[[5, 6, 7, 8]], sampling_params={"max_new_tokens": 4})

    def run(self, reqs: list[tuple[list[int], int]]) -> float:
        """Seconds for all requests at once."""
        self.engine.flush_cache()
        params = [{"max_new_tokens": m, "temperature": 0, "ignore_eos": True} for _, m in reqs]
        t = time.perf_counter()
        outs = self.engine.generate(input_ids=[p for p, _ in reqs], sampling_params=params)
        elapsed = time.perf_counter() - t
        assert sum(o["meta_info"]["completion_tokens"] for o in outs) == sum(m for _, m in reqs)
        return elapsed

    def run_timed(self, prompts: list[list[int]], tg: int) -> tuple[float, float]:
        """(seconds until every sequence has its first token, seconds in all) for one batch
        of prompts generating tg tokens each, streamed."""
        self.engine.flush_cache()
        params = {"max_new_tokens": tg, "temperature": 0, "ignore_eos": True}
        started: set[int] = set()
        done = [0] * len(prompts)
        first = None
        t = time.perf_counter()
        stream = self.engine.generate(input_ids=prompts, sampling_params=params, stream=True)
        for item in _stall_guard(stream, STALL_S):
            i = item.get("index", 0)
            done[i] = item["meta_info"]["completion_tokens"]
            started.add(i)
            if first is None and len(started) == len(prompts):
                first = time.perf_counter() - t
        total = time.perf_counter() - t
        assert done == [tg] * len(prompts), done
        return first, total

    def run_whole(self, prompts: list[list[int]], tg: int) -> tuple[float, float]:
        """run_timed's (first-token seconds, seconds in all) from two unstreamed runs, each on
        a flushed cache: the batch with max_new_tokens 1 (its prefill), then with tg. What a
        caller that waits for whole outputs pays: no per-token message leaves the scheduler
        (llama-batched-bench, too, times its loop with no client on the other end)."""
        times = []
        for n in (1, tg):
            self.engine.flush_cache()
            params = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
            t = time.perf_counter()
            outs = self.engine.generate(input_ids=prompts, sampling_params=params)
            times.append(time.perf_counter() - t)
            assert [o["meta_info"]["completion_tokens"] for o in outs] == [n] * len(prompts)
        return times[0], times[1]

    def decode_timing(self) -> dict[int, list]:
        info = self.engine.get_server_info()
        return {int(k): v for k, v in info["decode_timing"].items()}

    def close(self) -> None:
        self.engine.shutdown()


class LoomServerSide:
    """loom as an HTTP server (`loom serve`, warmed up once, the cache flushed before each run),
    sent the request set by the same client as llama-server (common.post_all: every request at
    once, each on its own connection): the side the llama-server peers are compared with, so
    both pay the same HTTP boundary."""

    def __init__(self, model_path: str, max_running: int, threads: int):
        from loom.runtime.server.runtime_client import Runtime

        self.rt = Runtime(
            model_path,
            max_running_requests=max_running,
            random_seed=0,
            cpu_threads=threads,
            log_level="warning",
        )
        common.post_json(self.rt.url + "/generate", self.body([5, 6, 7, 8], 4))

    @staticmethod
    def body(ids: list[int], n: int) -> dict:
        return {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0,
                                                      "ignore_eos": True}}  # fmt: skip

    def run(self, reqs: list[tuple[list[int], int]]) -> float:
        common.post(self.rt.url + "/flush_cache", {})  # answers plain text
        elapsed, outs = common.post_all(
            self.rt.url + "/generate", [self.body(p, m) for p, m in reqs]
        )
        got = sum(o["meta_info"]["completion_tokens"] for o in outs)
        assert got == sum(m for _, m in reqs), got
        return elapsed

    def decode_timing(self) -> dict[int, list]:
        import requests

        info = requests.get(self.rt.url + "/get_server_info", timeout=60).json()
        return {int(k): v for k, v in info["decode_timing"].items()}

    def close(self) -> None:
        self.rt.shutdown()


class HFSide:
    def __init__(self, model_path: str, pad_id: int):
        import torch
        import transformers

        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            model_path, dtype="auto"
        ).eval()
        self.pad = pad_id
        self.generate([[5, 6, 7, 8]], 4)  # warm-up, as loom gets

    def generate(self, prompts: list[list[int]], max_new: int) -> float:
        """Seconds for one padded (left) batch run to exactly max_new tokens."""
        t = time.perf_counter()
        self._generate(prompts, max_new)
        return time.perf_counter() - t

    def _generate(self, prompts: list[list[int]], max_new: int, streamer=None) -> None:
        torch = self.torch
        longest = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), longest), self.pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, longest - len(p) :] = torch.tensor(p)
            mask[i, longest - len(p) :] = 1
        with torch.inference_mode():
            self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=self.pad,
                streamer=streamer,
            )

    def generate_timed(self, prompts: list[list[int]], tg: int) -> tuple[float, float]:
        """(seconds to the first token of the batch, seconds in all) for one padded batch."""
        from transformers.generation.streamers import BaseStreamer

        marks: list[float] = []

        class Marks(BaseStreamer):
            def put(self, value):  # the prompt first, then each step's tokens
                marks.append(time.perf_counter())

            def end(self):
                pass

        t = time.perf_counter()
        self._generate(prompts, tg, streamer=Marks())
        total = time.perf_counter() - t
        assert len(marks) == tg + 1, len(marks)
        return marks[1] - t, total

    def static(self, reqs) -> float:
        return self.generate([p for p, _ in reqs], max(m for _, m in reqs))

    def serial(self, reqs) -> float:
        return sum(self.generate([p], m) for p, m in reqs)


def offline(args, label: str, path: str, tok, threads: int, peers: dict | None = None) -> dict:
    """peers: name -> factory(reqs) of a side with run(reqs) -> seconds and close()."""
    reqs = make_requests(tok, args.num_requests, args.seed, args.max_prompt, args.max_new)
    useful = sum(m for _, m in reqs)
    print(
        f"model {label} ({path})\n{len(reqs)} requests, prompt tokens {sum(len(p) for p, _ in reqs)}, "
        f"useful new tokens {useful}, threads {threads}, {args.rounds} rounds alternating"
    )
    loom_side = LoomSide(path, args.num_requests, threads)
    sides = []
    try:
        hf = HFSide(path, tok.pad_token_id if tok.pad_token_id is not None else 0)
        runs = {"loom": lambda: loom_side.run(reqs), "hf_static": lambda: hf.static(reqs)}
        if not args.skip_serial:
            runs["hf_serial"] = lambda: hf.serial(reqs)
        if peers:  # server peers meet loom's server, through the same client
            sides.append(server := LoomServerSide(path, args.num_requests, threads))
            runs["loom server"] = lambda: server.run(reqs)
        for name, factory in (peers or {}).items():
            sides.append(side := factory(reqs))
            runs[name] = lambda s=side: s.run(reqs)
        secs = common.alternate(runs, args.rounds)
        timing = loom_side.decode_timing()
    finally:
        for side in sides:
            side.close()
        loom_side.close()
    tps = {k: [useful / s for s in v] for k, v in secs.items()}
    names = {"loom": "loom Engine", "hf_static": "HF static batch", "hf_serial": "HF one at a time",
             "loom server": "loom server (HTTP)"}  # fmt: skip
    for k, v in tps.items():
        print(
            f"{names.get(k, k):22} {statistics.median(v):9.1f} tok/s  (median of {len(v)}; {min(v):.1f}-{max(v):.1f})"
        )
    out = {"model": label, "tok_s": {k: statistics.median(v) for k, v in tps.items()}}
    out["vs_static"] = common.ratio_summary(tps["loom"], tps["hf_static"])
    print(f"loom / HF static batch  {common.fmt_ratio(tps['loom'], tps['hf_static'])}")
    if "hf_serial" in tps:
        out["vs_serial"] = common.ratio_summary(tps["loom"], tps["hf_serial"])
        print(f"loom / HF one-at-a-time {common.fmt_ratio(tps['loom'], tps['hf_serial'])}")
    out["vs_peer"] = {}
    for name in peers or {}:  # server to server: loom's server against llama-server
        out["vs_peer"][name] = common.ratio_summary(tps["loom server"], tps[name])
        print(f"loom server / {name} (both HTTP, one client)  "
              f"{common.fmt_ratio(tps['loom server'], tps[name])}")  # fmt: skip
    steps, step_s, fwd_s = (sum(v[i] for v in timing.values()) for i in range(3))
    out["overhead"] = 1 - fwd_s / step_s
    print(
        f"all decode steps of all rounds (batch 1-{max(timing)}): {steps} steps, "
        f"{1000 * step_s / steps:.2f} ms/step, outside the model forward {100 * out['overhead']:.1f}%"
    )
    return out


def batched(args, label: str, path: str, tok, threads: int, peers: dict | None = None) -> dict:
    """Prefill and decode tok/s per batch size, loom, HF and the peers alternating per batch
    size. peers: name -> fn(B, pp, tg) -> (prefill tok/s, decode tok/s), measured by the peer."""
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    rng = random.Random(args.seed)
    vocab = len(tok)
    special = set(tok.all_special_ids)
    pool = [i for i in range(vocab) if i not in special]
    print(
        f"batched: model {label}, pp {args.pp}, tg {args.tg}, batch sizes {sizes}, threads {threads}"
    )
    loom_side = LoomSide(path, max(sizes), threads)
    rows = []
    try:
        hf = HFSide(path, tok.pad_token_id if tok.pad_token_id is not None else 0)
        for b in sizes:
            prompts = [[rng.choice(pool) for _ in range(args.pp)] for _ in range(b)]
            runs = {
                "loom": lambda p=prompts: loom_side.run_timed(p, args.tg),
                "hf": lambda p=prompts: hf.generate_timed(p, args.tg),
            }
            for name, fn in (peers or {}).items():
                runs[name] = lambda fn=fn, b=b: fn(b, args.pp, args.tg)
            t = common.alternate(runs, args.rounds)
            row = {"B": b}
            for side in ("loom", "hf"):
                row[f"{side}_prefill"] = statistics.median(b * args.pp / f for f, _ in t[side])
                row[f"{side}_decode"] = statistics.median(
                    b * (args.tg - 1) / (total - f) for f, total in t[side]
                )
            for name in peers or {}:
                row[f"{name}_prefill"] = statistics.median(x[0] for x in t[name])
                row[f"{name}_decode"] = statistics.median(x[1] for x in t[name])
            rows.append(row)
            print(
                f"B={b:3}  loom prefill {row['loom_prefill']:9.1f} tok/s decode {row['loom_decode']:8.1f} tok/s"
                f" | HF prefill {row['hf_prefill']:9.1f} tok/s decode {row['hf_decode']:8.1f} tok/s"
                f"; loom / HF: prefill {row['loom_prefill'] / row['hf_prefill']:.2f}x, decode "
                f"{row['loom_decode'] / row['hf_decode']:.2f}x"
            )
            for name in peers or {}:
                print(
                    f"       {name}: prefill {row[f'{name}_prefill']:9.1f} tok/s decode "
                    f"{row[f'{name}_decode']:8.1f} tok/s; loom / it: prefill "
                    f"{row['loom_prefill'] / row[f'{name}_prefill']:.2f}x, decode "
                    f"{row['loom_decode'] / row[f'{name}_decode']:.2f}x"
                )
    finally:
        loom_side.close()
    out = {"model": label, "pp": args.pp, "tg": args.tg, "threads": threads, "rows": rows}
    plot_throughput(out, ["loom", "HF", *(peers or {})])
    return out


def plot_throughput(bat: dict, sides: list[str]) -> None:
    """docs/img/throughput_{decode,prefill}_<model>.png: tok/s against batch size per side."""
    xs = [r["B"] for r in bat["rows"]]
    for what in ("decode", "prefill"):
        series = {
            {"loom": "loom", "HF": "HF transformers"}.get(s, s): (
                xs,
                [r[f"{'hf' if s == 'HF' else s}_{what}"] for r in bat["rows"]],
            )
            for s in sides
        }
        common.plot(
            f"throughput_{what}_{bat['model']}.png",
            f"{what} tok/s vs batch size ({bat['model']}, pp {bat['pp']}, tg {bat['tg']}, "
            f"{bat['threads']} thread(s))",
            "batch size",
            f"{what} tok/s",
            series,
            logx=True,
            logy=True,
        )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="bundled", help=f"one of {common.MODELS} or a model folder")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=400, help="prompt lengths 10..this")
    p.add_argument("--max-new", type=int, default=128, help="new tokens 8..this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (A B A B ...)")
    p.add_argument("--skip-serial", action="store_true", help="skip HF one-at-a-time")
    p.add_argument(
        "--threads", type=int, default=None, help="torch threads for both (default: loom's)"
    )
    p.add_argument("--batched", action="store_true", help="also the batch-size sweep")
    p.add_argument("--only-batched", action="store_true", help="only the batch-size sweep")
    p.add_argument("--batch-sizes", default="1,8,32,64")
    p.add_argument("--pp", type=int, default=128, help="batched: prompt tokens per sequence")
    p.add_argument("--tg", type=int, default=32, help="batched: new tokens per sequence")
    p.add_argument(
        "--llamacpp",
        action="store_true",
        help="llama.cpp as more sides (benchmarks/peers/llamacpp.py; builds it once if needed)",
    )
    return p


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    if args.tg < 2:
        raise SystemExit("--tg: must be >= 2 (decode time is the time after the first token)")
    import torch
    import transformers

    from loom.runtime.server_args import ServerArgs

    threads = args.threads or ServerArgs().effective_cpu_threads
    torch.set_num_threads(threads)
    label, path = common.resolve_model(args.model)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    print(common.header("bench_offline"))
    peers = {}
    if args.llamacpp:  # {"offline": {name: factory}, "batched": {name: fn}}
        sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
        import llamacpp

        peers = llamacpp.peers(args.model, threads)
    out = {}
    if not args.only_batched:
        out["offline"] = offline(args, label, path, tok, threads, peers.get("offline"))
    if args.batched or args.only_batched:
        out["batched"] = batched(args, label, path, tok, threads, peers.get("batched"))
    print(common.loadavg())
    return out


if __name__ == "__main__":
    main()
