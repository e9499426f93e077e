"""README.md's figure rows, each from the command that prints it (`run_all.py --readme`).

Every row of the README's benchmark table is a `Row`: the commands that measure it (benchmark
scripts and their arguments, run from the repository root) and a parser that reads the printed
output and returns the table's cells. `run_all.py --readme` runs the commands, keeps each row's
output in a log (its first line names the commit, the load and the commands) and prints the
markdown rows; `--readme-from LOGDIR` prints them again from the logs without rerunning. The
provenance in each row (commit and the range of the 1-minute load averages the run printed)
comes from the log, so a row printed from a log says where and under what load it ran.

A parser that does not find a figure it needs raises `RowError` naming the row and the line it
looked for: a changed benchmark output fails loudly instead of printing a stale cell.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import NamedTuple

LOG_HEAD = "# run_all --readme:"  # first line of every row's log: commit, load, commands


class RowError(RuntimeError):
    pass


class Row(NamedTuple):
    key: str
    commands: list[str]  # "script.py args..." relative to benchmarks/
    parse: Callable[[str], list[list[str]]]  # output -> [workload, loom, baseline, ratio] rows
    needs: tuple[str, ...] = ()  # "llamacpp", "maskbench": what the commands need installed


def grab(pattern: str, text: str, key: str, flags: int = re.M) -> re.Match:
    m = re.search(pattern, text, flags)
    if m is None:
        raise RowError(f"{key}: no output line matches {pattern!r}")
    return m


def provenance(text: str) -> str:
    """`commit X, load a–b` from a log: the commit from the runner's head line (or the first
    benchmark header that names one) and the range of every 1-minute load average printed."""
    m = re.search(r"commit (\S+?)[,;\s]", text)
    commit = m.group(1) if m else "unknown"
    loads = [float(x) for x in re.findall(r"load(?:avg| average)(?: at (?:start|end))? ([\d.]+)",
                                          text)]  # fmt: skip
    loads += [float(x) for x in re.findall(r"loadavg ([\d.]+) at start, ([\d.]+) at end", text)
              for x in x]  # fmt: skip
    loads += [float(x) for x in re.findall(r"(?:\(|, )load ([\d.]+)[,)]", text)]
    loads += [float(x) for x in re.findall(r"load sampled every 10 s: ([\d.]+) to ([\d.]+)", text)
              for x in x]  # fmt: skip
    if not loads:
        return f"commit `{commit}`, load not printed"
    lo, hi = min(loads), max(loads)
    shown = f"{lo:.1f}" if round(lo, 1) == round(hi, 1) else f"{lo:.1f}–{hi:.1f}"
    return f"commit `{commit}`, load {shown}"


def ratio(line: str) -> str:
    """`1.87x (1.58–2.30)` from a `1.87x (range 1.58-2.30, 3 rounds)` print."""
    m = re.search(r"([\d.]+)x \(range ([\d.]+)-([\d.]+)", line)
    if m is None:
        m = re.search(r"([\d.]+)x \(([\d.]+)-([\d.]+)\)", line)
    if m is None:
        raise RowError(f"no ratio with a range in {line!r}")
    return f"{m.group(1)}x ({m.group(2)}–{m.group(3)})"


# --------------------------------------------------------------------------- bench_offline


def _offline_rows(text: str, key: str, what: str) -> list[list[str]]:
    tps = {
        m.group(1).strip(): float(m.group(2))
        for m in re.finditer(r"^(\S.*?)\s+([\d.]+) tok/s  \(median of", text, re.M)
    }
    if "loom Engine" not in tps:
        raise RowError(f"{key}: no 'loom Engine ... tok/s' line")
    hf = [f"static batch {tps['HF static batch']:.1f}"]
    ratios = [ratio(grab(r"^loom / HF static batch .*$", text, key).group(0))]
    if "HF one at a time" in tps:
        hf.append(f"one at a time {tps['HF one at a time']:.1f}")
        ratios.append(ratio(grab(r"^loom / HF one-at-a-time .*$", text, key).group(0)))
    rows = [[
        f"{what}; in-process, each side alternating: loom's `Engine` against HF `generate`",
        f"{tps['loom Engine']:.1f} tok/s",
        "HF " + " / ".join(hf) + " tok/s",
        " / ".join(ratios),
    ]]  # fmt: skip
    peers = {k: v for k, v in tps.items() if k.startswith("llama.cpp")}
    if peers:
        best = max(peers, key=peers.get)
        line = grab(rf"^loom server / {re.escape(best)} \(both HTTP, one client\) .*$", text, key)
        shown = ", ".join(f"`{k[len('llama.cpp ') :]}` {v:.1f}" for k, v in peers.items())
        rows.append([
            "the same requests, **server to server**: a loom server against `llama-server`, the same "
            "requests sent by the same HTTP client; llama-server at -fa auto / off, per-slot KV "
            "and `--kv-unified`, the fastest quoted",
            f"{tps['loom server (HTTP)']:.1f} tok/s (loom server)",
            f"llama-server {shown} tok/s",
            f"{ratio(line.group(0))} against `{best[len('llama.cpp '):]}`",
        ])  # fmt: skip
    return rows


def offline_bundled(text: str) -> list[list[str]]:
    return _offline_rows(
        text, "offline-bundled", "32 requests, 10–200 prompt / 8–64 new tokens, bundled model"
    )


def offline_qwen(text: str) -> list[list[str]]:
    return _offline_rows(
        text, "offline-qwen", "16 requests, 10–64 prompt / 8–16 new tokens, 0.36B f32 model"
    )


def _batched_rows(text: str, key: str, what: str) -> list[list[str]]:
    rows = {}
    for m in re.finditer(
        r"^B=\s*(\d+)\s+loom prefill\s+([\d.]+) tok/s decode\s+([\d.]+) tok/s \| HF prefill\s+"
        r"([\d.]+) tok/s decode\s+([\d.]+) tok/s",
        text,
        re.M,
    ):
        b = int(m.group(1))
        rows[b] = {"loom": (float(m.group(2)), float(m.group(3))),
                   "HF": (float(m.group(4)), float(m.group(5)))}  # fmt: skip
        rest = text[m.end() :].split("\nB=")[0]
        for p in re.finditer(
            r"^\s+(llama\.cpp -fa \w+): prefill\s+([\d.]+) tok/s decode\s+([\d.]+) tok/s",
            rest,
            re.M,
        ):
            rows[b][p.group(1)] = (float(p.group(2)), float(p.group(3)))
    if not rows:
        raise RowError(f"{key}: no 'B=... loom prefill' lines")
    small, large = min(rows), max(rows)
    out = []
    for i, measure in ((1, "decode"), (0, "prefill")):
        loom = " / ".join(f"{rows[b]['loom'][i]:.1f}" for b in (small, large))
        hf = " / ".join(f"{rows[b]['HF'][i]:.1f}" for b in (small, large))
        r_hf = " / ".join(f"{rows[b]['loom'][i] / rows[b]['HF'][i]:.2f}x" for b in (small, large))
        base, rat = f"HF: {hf}", f"HF {r_hf}"
        peers = [k for k in rows[small] if k.startswith("llama.cpp")]
        if peers:
            fast = {b: max(peers, key=lambda k, b=b: rows[b][k][i]) for b in (small, large)}
            both = "; ".join(
                f"B={b}: " + ", ".join(f"`{k[10:]}` {rows[b][k][i]:.1f}" for k in peers)
                for b in (small, large)
            )
            base += f"; `llama-batched-bench` ({both})"
            rat += "; llama.cpp " + " / ".join(
                f"{rows[b]['loom'][i] / rows[b][fast[b]][i]:.2f}x (`{fast[b][10:]}`)"
                for b in (small, large)
            )
        head = what if measure == "decode" else "same sweep"
        out.append([f"{head}: {measure} tok/s at batch {small} / {large}; in-process, "
                    "alternating; llama.cpp's faster `-fa` per batch size quoted; medians of the "
                    "rounds (the sweep prints no range: read it as unstable under load)", loom,
                    base, rat])  # fmt: skip
    return out


def batched_bundled(text: str) -> list[list[str]]:
    return _batched_rows(text, "batched-bundled", "128-token prompts, 32 new, bundled model")


def batched_qwen(text: str) -> list[list[str]]:
    return _batched_rows(text, "batched-qwen", "16-token prompts, 8 new, 0.36B f32 model")


# --------------------------------------------------------------------------- prefix, programs


def prefix(text: str) -> list[list[str]]:
    key = "prefix"
    loom = grab(r"^loom\s+few-shot\s+([\d.]+) req/s", text, key).group(1)
    hf = grab(r"^hf\s+few-shot\s+([\d.]+) req/s", text, key).group(1)
    nocache = grab(r"^loom-nocache\s+few-shot\s+([\d.]+) req/s", text, key).group(1)
    m = grab(r"^few-shot\s+([\d.]+x \([\d.-]+\))\s+([\d.]+x \([\d.-]+\))", text, key)
    hit = grab(r"^few-shot\s.*?([\d.]+%)\s*$", text, key).group(1)
    return [[
        "few-shot: 375-token shared prefix, 16 country-capital questions (**the bundled model's "
        f"own training facts**; a throughput row, the answers do not matter); hit rate {hit}",
        f"{loom} req/s",
        f"HF `generate`, one padded batch: {hf} req/s (loom, cache off: {nocache})",
        f"{ratio(m.group(1))} ({ratio(m.group(2))} against cache off)",
    ]]  # fmt: skip


def programs(text: str) -> list[list[str]]:
    key = "programs"
    lang = grab(r"^tree of thought\s+language \+ cache\s+[\d.]+ s\s+([\d.]+) programs/s", text, key)
    bat = grab(r"^tree of thought\s+batched calls\s+[\d.]+ s\s+([\d.]+) programs/s", text, key)
    seq = re.search(r"^tree of thought\s+sequential calls\s+[\d.]+ s\s+([\d.]+) programs/s",
                    text, re.M)  # fmt: skip
    m = grab(r"^tree of thought\s+\d+\s+\d+\s+\d+\s+([\d.]+x \([\d.-]+\))\s+([\d.]+x \([\d.-]+\))"
             r"\s+(\S+ \([\d.-]+\)|-)", text, key)  # fmt: skip
    base = f"the same calls batched by hand through `engine.generate`: {bat.group(1)} programs/s"
    rat = ratio(m.group(1))
    if seq is not None:
        base += f" (one at a time: {seq.group(1)})"
        rat += f" ({ratio(m.group(3))} against one at a time)"
    return [["`fork(8)` tree-of-thought program, bundled model", f"{lang.group(1)} programs/s",
             base, rat]]  # fmt: skip


def serving(text: str) -> list[list[str]]:
    key = "serving"
    sat = grab(r"^\s*saturation\s+\d+\s+([\d.]+)", text, key).group(1)
    eng = grab(r"^in-process Engine at saturation: ([\d.]+) req/s", text, key).group(1)
    r = grab(r"^server / engine \(requests/s\): .*$", text, key).group(0)
    return [["HTTP server at saturation, 32 streaming requests, bundled model",
             f"{sat} req/s", f"in-process Engine, same requests: {eng} req/s", ratio(r)]]  # fmt: skip


# --------------------------------------------------------------------------- grammars


def _engine_tables(text: str, key: str) -> list[tuple[dict[str, tuple[int, int]], int]]:
    """Every engine table maskbench_coverage printed: ({label without versions: (pass,
    invalid accepted)}, schemas done by every engine of that table)."""
    tables = []
    for head in re.finditer(r"^engine\s+pass compile_error", text, re.M):
        body = text[head.end() :]
        n = grab(r"^schemas: (\d+) done by every engine", body, key)
        rows = {}
        for m in re.finditer(r"^(\S.*?\])(?: \(\w+\))?\s+(\d+)\s+\d+\s+\d+\s+(\d+)",
                             body[: n.start()], re.M):  # fmt: skip
            rows[re.sub(r" [\d.]+(?= )", "", m.group(1))] = (int(m.group(2)), int(m.group(3)))
        tables.append((rows, int(n.group(1))))
    if not tables:
        raise RowError(f"{key}: no engine table")
    return tables


def _maskbench(text: str, key: str, what: str) -> list[list[str]]:
    """Strict and llguidance rows from the report over the most engines; xgrammar non-strict
    and llguidance's relaxed options where the run has them."""
    tables = _engine_tables(text, key)
    total = grab(r"^schemas: \d+ done by every engine, of (\d+)", text, key).group(1)

    def table_with(name: str) -> tuple[dict, int]:
        having = [t for t in tables if name in t[0]]
        if not having:
            raise RowError(f"{key}: no engine row {name!r}")
        return max(having, key=lambda t: (t[1], len(t[0])))  # the report over most engines

    wide, n = table_with("xgrammar [strict]")
    loom, spec, xs = wide["loom [strict]"], wide["loom [spec]"], wide["xgrammar [strict]"]
    llg = wide["llguidance [spec]"]
    if n < int(total):  # a resumed run not finished by every engine
        what += (" (a run not finished by every engine: the files go interleaved, so the "
                 "schemas every engine finished are a spread sample of every subset)")  # fmt: skip
    rows = [
        [f"{what}: {n} of {total} schemas; **strict against strict** (unlisted keys refused: "
         "loom's default, xgrammar `strict_mode=True`, MaskBench's default); timeouts (30 s CPU) "
         f"count as failures; invalid instance accepted: loom {loom[1]}, xgrammar {xs[1]} schemas",
         f"{loom[0]} pass", f"xgrammar strict: {xs[0]}", f"{loom[0] / xs[0]:.2f}x"],
        [f"same {n} schemas, **JSON Schema's own rules** (unlisted keys allowed): loom-spec "
         f"against llguidance's default; invalid accepted: loom-spec {spec[1]}, llguidance {llg[1]}",
         f"{spec[0]} pass", f"llguidance: {llg[0]}", f"{spec[0] / llg[0]:.2f}x"],
    ]  # fmt: skip
    if any("xgrammar nonstrict [spec]" in t[0] for t in tables):
        nonstrict, n_xn = table_with("xgrammar nonstrict [spec]")
        xn, spec_xn = nonstrict["xgrammar nonstrict [spec]"], nonstrict["loom [spec]"]
        part = f"the same {n} schemas" if n_xn == n else f"{n_xn} of those schemas"
        rows.append(
            [f"JSON Schema's rules against xgrammar `strict_mode=False` (MaskBench's compliant "
             f"setting), {part}; invalid accepted: loom-spec {spec_xn[1]}, xgrammar non-strict "
             f"{xn[1]}", f"{spec_xn[0]} pass", f"xgrammar non-strict: {xn[0]}",
             f"{spec_xn[0] / xn[0]:.2f}x"])  # fmt: skip
    if any("llguidance coerce [relaxed]" in t[0] for t in tables):
        coerce = table_with("llguidance coerce [relaxed]")[0]["llguidance coerce [relaxed]"]
        lenient = table_with("llguidance lenient [relaxed]")[0]["llguidance lenient [relaxed]"]
        rows.append(
            [f"same {n} schemas, beyond the spec (not a headline): llguidance's `coerce_one_of` "
             "and `lenient` options", "-", f"llguidance coerce: {coerce[0]}, lenient: "
             f"{lenient[0]}", "-"])  # fmt: skip
    return rows


MB_ENGINES = ("loom", "loom-spec", "llguidance", "xgrammar", "llguidance-coerce",
              "llguidance-lenient", "xgrammar-nonstrict")  # fmt: skip


def _maskbench_steps(key: str, select: str, engines: tuple[str, ...]) -> list[str]:
    """One maskbench_coverage process per engine into one --out file (resumable), then one
    report over every engine."""
    run = f"maskbench_coverage.py {select} --timeout 30".replace("  ", " ")
    out = f"--out {{logdir}}/{key}.jsonl"
    return [f"{run} --engines {e} {out} --resume" for e in engines] + [
        f"{run} {out} --engines {','.join(engines)} --report-only"
    ]


def maskbench_full(text: str) -> list[list[str]]:
    return _maskbench(
        text, "maskbench-full", "MaskBench JSON schemas at Llama 3's 128k tokenizer, the whole "
        "corpus, MaskBench's walk rules, every engine through one harness"
    )  # fmt: skip


def maskbench_128k(text: str) -> list[list[str]]:
    return _maskbench(
        text, "maskbench-128k", "MaskBench JSON schemas at Llama 3's 128k tokenizer, every 40th "
        "schema of 11,305 (a fixed, stated subset: sorted file names, every 40th; it has every "
        "mode, xgrammar non-strict included, which is too slow at 128k for the whole corpus "
        "here), MaskBench's walk rules, every engine through one harness"
    )  # fmt: skip


def _grammar_engines(text: str, key: str) -> dict[str, list[str]]:
    out = {}
    for m in re.finditer(r"^  (\S.*?\])(?: \(\w+\))?\s+(\d+/\d+)\s+([\d.]+ ms)\s+([\d.]+ ms)\s+"
                         r"[\d.]+ ms\s+([\d.]+ us)\s+([\d.]+ us)", text, re.M):  # fmt: skip
        out[m.group(1)] = [m.group(i) for i in range(2, 7)]
    if not out:
        raise RowError(f"{key}: no engine table")
    return out


def grammar_128k(text: str) -> list[list[str]]:
    key = "grammar-128k"
    eng = _grammar_engines(text, key)
    n = grab(r"^tokenizer (.+?); (\d+) MaskBench schemas \(every (\d+)th", text, key)
    spec = next(v for k, v in eng.items() if k.startswith("loom [spec]"))
    llg = next(v for k, v in eng.items() if k.startswith("llguidance") and k.endswith("[spec]"))
    r = grab(r"^\s+\[spec\] loom-spec / llguidance: compile p50 ([\d.]+x).*?compile p99 "
             r"([\d.]+x).*?mask p50 ([\d.]+x)", text, key)  # fmt: skip
    return [
        [
            f"{n.group(2)} MaskBench schemas (every {n.group(3)}th with a valid instance), tokenizer "
            f"{n.group(1)}, **like for like**: JSON Schema's rules on both sides (loom-spec against "
            "llguidance's default), every engine's first walk step left out (each made that mask "
            "inside its timed compile); one thread, CPU time; compile (to first mask) p50 / p99 / "
            f"mask step p50; compiled {spec[0]} against {llg[0]}",
            f"{spec[1]} / {spec[2]} / {spec[3]}",
            f"llguidance: {llg[1]} / {llg[2]} / {llg[3]}",
            f"{r.group(1)} / {r.group(2)} / {r.group(3)} (lower is better)",
        ]
    ]


def jump_forward(text: str) -> list[list[str]]:
    key = "jump-forward"
    out = []
    for label, what in (("4 long keys + const", "schema with 4 long keys and a const"),
                        ("3 short keys", "schema with 3 short keys")):  # fmt: skip
        m = grab(rf"^\s+{re.escape(label)}\s+jump-forward on/off: ([\d.]+)x documents/s \(rounds "
                 r"([^;]+); range ([\d.]+)-([\d.]+)\); (\d+) tokens jumped per run \(median\); "
                 r"(\d+)/(\d+) documents identical", text, key)  # fmt: skip
        on = [float(x) for x in re.findall(rf"^\s+{re.escape(label)}\s+round \d+ jump-forward on :"
                                           r"\s+([\d.]+) docs/s", text, re.M)]  # fmt: skip
        off = [float(x) for x in re.findall(rf"^\s+{re.escape(label)}\s+round \d+ jump-forward off:"
                                            r"\s+([\d.]+) docs/s", text, re.M)]  # fmt: skip
        tokens = grab(rf"^\s+{re.escape(label)}\s+round \d+ jump-forward o\w+\s*:.*?\((\d+) tokens",
                      text, key).group(1)  # fmt: skip
        jumped = int(m.group(5))
        share = f"{jumped:,} of {int(tokens):,} tokens jumped ({100 * jumped / int(tokens):.0f}%)"
        if not jumped:
            share = "**nothing to jump** (0 tokens jumped): the ratio is noise around 1"
        lo, hi = float(m.group(3)), float(m.group(4))
        verdict = ("; the spread includes 1: the gain is not established here"
                   if jumped and lo < 1.0 else "")  # fmt: skip
        head = ("64 JSON extractions (**the bundled model's own training distribution**), "
                f"{len(on)} alternating rounds in fresh Engines: {what}")  # fmt: skip
        out.append(
            [
                f"{head if not out else 'same requests: ' + what}; {share}; "
                f"{m.group(6)}/{m.group(7)} documents identical on and off",
                " / ".join(f"{x:.1f}" for x in on) + " docs/s (rounds)",
                "loom with `--disable-jump-forward`: " + " / ".join(f"{x:.1f}" for x in off),
                f"{m.group(1)}x ({lo:.2f}–{hi:.2f}){verdict}",
            ]
        )
    return out


def first_request(text: str) -> list[list[str]]:
    key = "first-request"
    m = grab(r"extra TTFT per new schema: first ([\d.]+) ms, p50 ([\d.]+) ms, worst ([\d.]+) ms"
             r".*?llguidance compile p50 ([\d.]+) ms, worst ([\d.]+) ms", text, key)  # fmt: skip
    b = grab(r"^bound .*$", text, key).group(0)
    n = grab(r"(\d+) new schemas", text, key).group(1)
    return [
        [
            f"first constrained requests at Llama 3's 128k vocabulary (random one-layer model): "
            f"extra time to first token of {n} new JSON schemas",
            f"first {m.group(1)} ms, p50 {m.group(2)} ms, worst {m.group(3)} ms",
            f"llguidance's own compile of each schema: p50 {m.group(4)} ms, worst {m.group(5)} ms",
            b.replace("bound ", "bound: "),
        ]
    ]


def engine_room(text: str) -> list[list[str]]:
    key = "engine-room"
    out = []
    # format_row: "B=  N (load ...)" then its fields on indented lines
    for m in re.finditer(r"^B=\s*(\d+) \(load [\d.]+.*?(?=^\S|\Z)", text, re.M | re.S):
        block = m.group(0)
        dec = grab(r"decode cpu_paged / llama\.cpp (\S+ \([^)]*\))", block, key).group(1)
        fa = grab(r"llama\.cpp (-fa .*?) decode tok/s;", block, key).group(1)
        tps = grab(r"loom (\d+) vs llama\.cpp (\d+) decode tok/s", block, key)
        out.append((int(m.group(1)), dec, fa, tps.group(1)))
    if not out:
        raise RowError(f"{key}: no 'B=... (load' lines")
    return [[
        f"decode tok/s at batch {b}, compiled CPU forward, 128-token prompts, bundled model, one "
        "thread each, loom streamed; `llama-batched-bench` at `-fa off` and `-fa auto`, the "
        "faster quoted", f"{loom}", f"llama.cpp {fa}", ratio(dec)]
        for b, dec, fa, loom in out]  # fmt: skip


ROWS = [
    Row("offline-bundled",
        ["bench_offline.py --num-requests 32 --max-prompt 200 --max-new 64 --rounds 3 --llamacpp"],
        offline_bundled, ("llamacpp",)),
    Row("offline-qwen",
        ["bench_offline.py --num-requests 16 --max-prompt 64 --max-new 16 --rounds 2 --skip-serial "
         "--model qwen0.5b-f32 --llamacpp"], offline_qwen, ("llamacpp",)),
    Row("batched-bundled",
        ["bench_offline.py --only-batched --batch-sizes 1,8,32,64 --pp 128 --tg 32 --rounds 2 "
         "--llamacpp"], batched_bundled, ("llamacpp",)),
    Row("batched-qwen",
        ["bench_offline.py --only-batched --batch-sizes 1,8,32,64 --pp 16 --tg 8 --rounds 2 "
         "--model qwen0.5b-f32 --llamacpp"], batched_qwen, ("llamacpp",)),
    Row("prefix", ["bench_prefix.py --rounds 3 --scale 0.25"], prefix),
    Row("programs", ["bench_programs.py --rounds 2 --scale 0.25"], programs),
    Row("serving", ["bench_serving.py --num-prompts 32 --request-rates 2,8,32 --rounds 3"], serving),
    # one engine per process: a worker respawned after a timeout rebuilds only its own engine
    # (seven 128k engines per respawn did not fit a loaded machine), then one report of all
    Row("maskbench-128k", _maskbench_steps("maskbench-128k", "--stride 40", MB_ENGINES),
        maskbench_128k, ("maskbench",)),
    # the whole corpus, the headline engines (xgrammar non-strict: ~2.4 s of CPU a schema at
    # 128k, ~7 h for the corpus; the relaxed llguidance options are not headlines)
    Row("maskbench-full",
        _maskbench_steps("maskbench-full", "", ("loom", "xgrammar", "loom-spec", "llguidance")),
        maskbench_full, ("maskbench",)),
    # xgrammar non-strict left out: at 128k its compiles take tens of seconds a schema here
    Row("grammar-128k",
        ["bench_grammar.py --stride 40 --skip-e2e --engines loom,loom-spec,llguidance,xgrammar"],
        grammar_128k, ("maskbench",)),
    Row("jump-forward", ["bench_grammar.py --only-e2e --requests 64 --e2e-rounds 3"], jump_forward),
    Row("first-request", ["bench_grammar_first_request.py --schemas 20"], first_request),
    Row("engine-room",
        ["bench_engine_room.py --batch-sizes 1,32,64 --rounds 3 --sides cpu_paged"], engine_room,
        ("llamacpp",)),
]  # fmt: skip
BY_KEY = {r.key: r for r in ROWS}


def markdown(row: Row, text: str) -> list[str]:
    """The row's markdown lines: | command | workload; provenance | loom | baseline | ratio |."""
    cells = row.parse(text)
    prov = provenance(text)
    shown = [c for c in row.commands if "--report-only" not in c]
    cmd = f"`python benchmarks/{shown[0].split(' --out')[0]}`"
    if len(shown) > 1:
        cmd = (f"`python benchmarks/run_all.py --readme --rows {row.key}` ({len(row.commands)} "
               f"steps: {shown[0].split(' --engines')[0]}, one engine per process)")  # fmt: skip
    lines = []
    for i, (work, loom, base, rat) in enumerate(cells):
        if i == 0:
            lines.append(f"| {cmd} | {work}; {prov} | {loom} | {base} | {rat} |")
        else:
            lines.append(f"| same run | {work} | {loom} | {base} | {rat} |")
    return lines
