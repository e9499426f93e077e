"""Every benchmark in one run, then one table of ratios against their targets.

    python benchmarks/run_all.py --quick          # every benchmark at a small size (< 10 min idle)
    python benchmarks/run_all.py                  # the sizes docs/benchmarks.md quotes
    python benchmarks/run_all.py --models bundled,qwen0.5b-f32,qwen0.5b-bf16 --llamacpp

The loom benchmarks run in this process one after another (each prints its own table, the
machine, the commit and the load before and after); the grammar benchmarks (G-BENCH's) run as
subprocesses at their small sizes. llama.cpp rows: when --llamacpp is given (it builds llama.cpp
once, ~15 min on 2 idle cores) or its build is already cached, the offline and batch-sweep runs
get `--llamacpp` (bench_offline then checks llama.cpp's tokenization and greedy tokens against
loom's and alternates llama-server / llama-batched-bench with loom and HF in every round).
Every benchmark writes its plots into docs/img/ (throughput against batch size, TTFT/ITL against
request rate, prefix-cache hit rate against speed-up). Ratios are medians of per-round ratios
(A B A B ...), with the range; on a shared machine read them, not the absolute figures.

README.md's figure rows come from `--readme` (benchmarks/readme_rows.py: each row's commands and
the parser of their output):

    python benchmarks/run_all.py --readme                       # every row: run, log, print
    python benchmarks/run_all.py --readme --rows prefix,serving # some rows
    python benchmarks/run_all.py --readme-from /tmp/loom_readme # print the rows from the logs
    python benchmarks/run_all.py --readme-from /tmp/loom_readme --docs  # docs/benchmarks.md's logs

Each row's output goes to LOGDIR/<row>.log (--readme-logs), whose first line names the commit,
the load and the commands; the printed row carries that commit and the range of the 1-minute
load averages printed during the run. Rows that need llama.cpp are left out, and say so, when
its build is not cached (it is not built by --readme).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "peers"))

import bench_offline  # noqa: E402
import bench_prefix  # noqa: E402
import bench_programs  # noqa: E402
import bench_serving  # noqa: E402
import common  # noqa: E402
import readme_rows  # noqa: E402

# (quick, full) arguments per benchmark and model size: "small" = the bundled 3.9M model,
# "large" = the 0.36B Qwen2.5-0.5B-shaped models (a few tok/s per core in f32 on a CPU, so their
# workloads are cut to what 2 shared cores finish; the tables say which sizes ran). The full
# sizes are what a loaded 2-core machine finishes in about half an hour for bundled + one 0.5B
# model; each benchmark's own defaults are larger.
PLANS = {
    "offline": {
        "small": (
            "--num-requests 16 --max-prompt 200 --max-new 64 --rounds 2 --skip-serial",
            "--num-requests 32 --max-prompt 200 --max-new 64 --rounds 3",
        ),
        "large": (
            "--num-requests 4 --max-prompt 32 --max-new 8 --rounds 1 --skip-serial",
            "--num-requests 16 --max-prompt 64 --max-new 16 --rounds 2 --skip-serial",
        ),
    },
    "batched": {
        "small": (
            "--only-batched --batch-sizes 1,8,32,64 --pp 32 --tg 8 --rounds 1",
            "--only-batched --batch-sizes 1,8,32,64 --pp 128 --tg 32 --rounds 2",
        ),
        "large": (
            "--only-batched --batch-sizes 1,8 --pp 8 --tg 8 --rounds 1",
            "--only-batched --batch-sizes 1,8,32,64 --pp 16 --tg 8 --rounds 2",
        ),
    },
    "prefix": {"small": ("--rounds 1 --scale 0.25", "--rounds 3 --scale 0.25"), "large": None},
    "programs": {
        "small": ("--rounds 1 --scale 0.25 --skip-sequential", "--rounds 2 --scale 0.25"),
        "large": None,
    },
    "serving": {
        "small": (
            "--num-prompts 16 --request-rates 4,16 --rounds 1",
            "--num-prompts 32 --request-rates 2,8,32 --rounds 3",
        ),
        "large": None,
    },
}
GRAMMAR = [  # G-BENCH's benchmarks at small sizes; their output is shown as printed
    ("bench_grammar", ["--stride", "800", "--instances", "1", "--skip-e2e"]),
    ("bench_grammar", ["--only-e2e", "--requests", "8"]),
    ("maskbench_coverage", ["--stride", "800", "--timeout", "20"]),
]
TARGETS = {  # name -> (target, higher is better)
    "offline: loom / HF static batch": (3.0, True),
    "offline: loom / HF one at a time": (20.0, True),
    "offline: decode overhead outside the forward": (0.15, False),
    # server to server, one client; llama-server with its default per-slot KV and --kv-unified
    **{
        f"offline: loom server / llama.cpp -fa {fa}{uni}": (1.0, True)
        for fa in ("auto", "off")
        for uni in ("", " --kv-unified")
    },
    # llama-batched-bench's faster -fa setting at that batch size
    "decode, smallest batch: loom / llama.cpp, faster -fa": (None, True),
    "decode, largest batch: loom / llama.cpp, faster -fa": (None, True),
    "prefix few-shot: loom / HF": (4.0, True),
    "prefix few-shot: loom / loom cache off": (4.0, True),
    "programs tree of thought: language / batched calls": (1.0, True),
    "programs tree of thought: language / sequential calls": (4.0, True),
    "serving: server / Engine at saturation": (0.9, True),
}


def argv(plan: tuple[str, str] | None, quick: bool, model: str) -> list[str] | None:
    if plan is None:
        return None
    return [*plan[0 if quick else 1].split(), "--model", model]


def _sample_load(samples: list[float], stop: threading.Event) -> None:
    """The 1-minute load average every 10 s until `stop` is set."""
    while not stop.wait(10):
        samples.append(os.getloadavg()[0])


def readme(a) -> None:
    """Run (or, with --readme-from, only read the logs of) README.md's figure rows and print
    them as markdown table rows."""
    import llamacpp

    keys = a.rows.split(",") if a.rows else [r.key for r in readme_rows.ROWS]
    unknown = [k for k in keys if k not in readme_rows.BY_KEY]
    if unknown:
        raise SystemExit(f"--rows: unknown {unknown}; expected some of {list(readme_rows.BY_KEY)}")
    logdir = Path(a.readme_from or a.readme_logs)
    logdir.mkdir(parents=True, exist_ok=True)
    lines = []
    for key in keys:
        row = readme_rows.BY_KEY[key]
        log = logdir / f"{key}.log"
        commands = [c.format(logdir=logdir) for c in row.commands]
        if not a.readme_from:
            if "llamacpp" in row.needs and not llamacpp.built():
                lines.append(f"<!-- {key}: not run: llama.cpp is not built "
                             "(python benchmarks/peers/llamacpp.py build) -->")  # fmt: skip
                continue
            with open(log, "w") as f:
                f.write(f"{readme_rows.LOG_HEAD} commit {common.commit()}; {common.loadavg()}; "
                        f"{' && '.join(commands)}\n")  # fmt: skip
            # the benchmarks print the load at their start and end; a sampler catches the peaks
            # between (on a shared machine they are what moved the figures)
            samples, stop = [], threading.Event()
            sampler = threading.Thread(target=_sample_load, args=(samples, stop), daemon=True)
            sampler.start()
            for c in commands:
                print(f"\n===== {key}: python benchmarks/{c}", flush=True)
                argv = [sys.executable, str(HERE / c.split()[0]), *shlex.split(c)[1:]]
                with open(log, "a") as f:
                    proc = subprocess.Popen(argv, stdout=subprocess.PIPE,
                                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
                    for out in proc.stdout:
                        f.write(out)
                        print(out, end="", flush=True)
                    if proc.wait():
                        f.write(f"exit status {proc.returncode}\n")
                        break
            stop.set()
            sampler.join()
            sampled = (f"; load sampled every 10 s: {min(samples):.2f} to {max(samples):.2f}"
                       if samples else "")  # fmt: skip
            with open(log, "a") as f:
                f.write(f"{readme_rows.LOG_HEAD} end; {common.loadavg()}{sampled}\n")
        if not log.exists():
            lines.append(f"<!-- {key}: no log at {log} -->")
            continue
        try:
            lines += readme_rows.markdown(row, log.read_text())
        except readme_rows.RowError as e:
            lines.append(f"<!-- {key}: {e} (log: {log}) -->")
    if a.docs:
        _docs(keys, logdir)
        return
    print("\n| command | workload | loom | baseline | ratio |\n|---|---|---|---|---|")
    print("\n".join(lines))


def _docs(keys: list[str], logdir: Path) -> None:
    """docs/benchmarks.md's section of the rows' logs: per row, the command and its whole log
    (its first line names the commit, the load and the commands), then the rows it gives."""
    for key in keys:
        row, log = readme_rows.BY_KEY[key], logdir / f"{key}.log"
        print(f"\n#### `{key}`\n\n`python benchmarks/run_all.py --readme --rows {key}`:\n")
        if not log.exists():
            print("    (not run: no log)")
            continue
        text = log.read_text()
        print("\n".join("    " + line if line else "" for line in text.rstrip().split("\n")))
        try:
            rows = readme_rows.markdown(row, text)
        except readme_rows.RowError as e:
            print(f"\n(no README row: {e})")
            continue
        print("\n| command | workload | loom | baseline | ratio |\n|---|---|---|---|---|")
        print("\n".join(rows))


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="every benchmark at a small size")
    p.add_argument("--models", default=None, help="default: bundled (quick) or all three")
    p.add_argument(
        "--llamacpp", action="store_true", help="build llama.cpp if needed and add its rows"
    )
    p.add_argument("--skip-grammar", action="store_true")
    p.add_argument("--grammar-timeout", type=int, default=600, help="seconds per grammar benchmark")
    p.add_argument(
        "--only", default=None, help="comma list of offline,batched,prefix,programs,serving"
    )
    p.add_argument("--json", default=None, help="write every result to this file")
    p.add_argument("--readme", action="store_true", help="run README.md's figure rows, print them")
    p.add_argument("--rows", default=None, help="--readme: comma list of readme_rows.ROWS keys")
    p.add_argument("--readme-logs", default="/tmp/loom_readme", help="--readme: the rows' logs")
    p.add_argument(
        "--readme-from", default=None, help="print README rows from this folder's logs, run none"
    )
    p.add_argument(
        "--docs", action="store_true", help="with --readme-from: the logs as docs markdown"
    )
    a = p.parse_args()
    if a.readme or a.readme_from:
        readme(a)
        return
    models = (a.models or ("bundled" if a.quick else ",".join(common.MODELS))).split(",")
    only = set(a.only.split(",")) if a.only else set(PLANS)
    t0 = time.time()
    print(common.header("run_all" + (" --quick" if a.quick else "")), flush=True)
    import llamacpp

    have_llama = a.llamacpp or llamacpp.built()
    results: dict = {}
    rows: list[tuple[str, str, tuple[float, float, float] | float]] = []
    for model in models:
        size = "small" if model == "bundled" else "large"
        for bench, fn in (
            ("offline", bench_offline.main),
            ("batched", bench_offline.main),
            ("prefix", bench_prefix.main),
            ("programs", bench_programs.main),
            ("serving", bench_serving.main),
        ):
            args = argv(PLANS[bench][size], a.quick, model)
            if bench not in only or args is None:
                continue
            if have_llama and bench in ("offline", "batched"):
                args.append("--llamacpp")
            print(
                f"\n===== {bench} {model} (at {time.time() - t0:.0f} s): {' '.join(args)}",
                flush=True,
            )
            results[(bench, model)] = r = fn(args)
            if bench == "offline":
                o = r["offline"]
                rows.append((model, "offline: loom / HF static batch", o["vs_static"]))
                if "vs_serial" in o:
                    rows.append((model, "offline: loom / HF one at a time", o["vs_serial"]))
                rows.append((model, "offline: decode overhead outside the forward", o["overhead"]))
                for name, v in o["vs_peer"].items():
                    rows.append((model, f"offline: loom server / {name}", v))
            elif bench == "batched" and have_llama:
                b = r["batched"]["rows"]
                for which, row in (("smallest", b[0]), ("largest", b[-1])):
                    peer = max(row[f"llama.cpp -fa {fa}_decode"] for fa in ("auto", "off"))
                    v = row["loom_decode"] / peer
                    rows.append((model, f"decode, {which} batch: loom / llama.cpp, faster -fa", v))
            elif bench == "prefix":
                w = r["workloads"]["few-shot"]
                rows.append((model, "prefix few-shot: loom / HF", w["vs_hf"]))
                rows.append((model, "prefix few-shot: loom / loom cache off", w["vs_nocache"]))
            elif bench == "programs":
                t = r["programs"]["tree of thought"]
                rows.append(
                    (model, "programs tree of thought: language / batched calls", t["batched"])
                )
                if "sequential" in t:
                    rows.append(
                        (
                            model,
                            "programs tree of thought: language / sequential calls",
                            t["sequential"],
                        )
                    )
            elif bench == "serving" and "server_vs_engine" in r:
                rows.append(
                    (model, "serving: server / Engine at saturation", r["server_vs_engine"])
                )
    if not a.skip_grammar:
        for script, extra in GRAMMAR:
            cmd = [sys.executable, str(HERE / f"{script}.py"), *extra]
            print(f"\n===== {script} (at {time.time() - t0:.0f} s) {' '.join(extra)}", flush=True)
            try:
                subprocess.run(cmd, check=False, timeout=a.grammar_timeout)
            except subprocess.TimeoutExpired:
                print(f"{script}: stopped after {a.grammar_timeout} s (--grammar-timeout)")
    print(
        f"\n===== summary ({time.time() - t0:.0f} s; {common.loadavg()}; commit {common.commit()})"
    )
    print(f"{'model':14} {'measure':55} {'measured':>28} {'target':>8}  met")
    for model, name, v in rows:
        target, higher = TARGETS[name]
        if isinstance(v, tuple):
            shown = f"{v[0]:.2f}x ({v[1]:.2f}-{v[2]:.2f})"
            med = v[0]
        elif higher:  # a single ratio (one round of one batch size)
            shown, med = f"{v:.2f}x", v
        else:
            shown, med = f"{100 * v:.1f}%", v
        if target is None:
            tshown, met = "-", "-"
        else:
            tshown = f"{target:g}x" if higher else f"<={100 * target:g}%"
            met = "yes" if (med >= target if higher else med <= target) else "no"
        print(f"{model:14} {name:55} {shown:>28} {tshown:>8}  {met}")
    if a.json:
        Path(a.json).write_text(
            json.dumps({f"{k[0]}:{k[1]}": v for k, v in results.items()}, indent=1)
        )


if __name__ == "__main__":
    main()
