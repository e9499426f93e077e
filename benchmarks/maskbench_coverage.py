"""MaskBench like for like: loom, llguidance and xgrammar through one harness, one table.

Every engine gets the same schemas, the same tokenizer and MaskBench's walk rules (its
`runner.py`): each test instance is serialized with `json.dumps` and its default separators
(", " and ": "), tokenized without special tokens and walked token by token; each step fills
the mask, checks the token's bit and, if set, accepts the token. A valid instance is handled
right when every token is allowed; an invalid one when some token is rejected. There is no
end-of-sequence check in MaskBench, so an invalid instance that is a prefix of a valid one
(`1` where the minimum is 10) counts as accepted. Whether EOS was allowed after each valid
walk is recorded beside it (`valid_no_eos`) without changing the verdict.

A schema *passes* when it compiles and every instance is handled right. Otherwise its status
is `compile_error` (the engine refused it: any exception, as in MaskBench), `wrong_invalid`
(an invalid instance accepted: the soundness failure, reported first), `wrong_valid` (a valid
instance rejected), `timeout` (over --timeout seconds of the worker's own CPU time, compile
and walks together), `memory` (the worker passed --max-rss-gb) or `crash` (the worker died,
or the engine raised while walking).

    python benchmarks/maskbench_coverage.py [--tokenizer llama3|bundled|HF_DIR]
        [--engines loom,loom-spec,llguidance,xgrammar] [--loom-engine NAME] [--workers 1]
        [--timeout 30] [--stride K] [--limit N] [--files names.txt] [--out f.jsonl] [--resume]

Engines, by mode (MODES; a headline compares engines of one mode only): strict -- `loom`,
loom's GrammarBackend with its defaults (unlisted object keys forbidden), and `xgrammar`,
`GrammarCompiler(max_threads=1, cache_enabled=False)` with MaskBench's default settings
(`strict_mode=True`, `any_whitespace=False`); spec (JSON Schema's own rules) -- `loom-spec`
(`additional_properties_default=True`), `llguidance` (`LLMatcher` with its default JSON
options) and `xgrammar-nonstrict` (`strict_mode=False`, MaskBench's JSON-Schema-compliant
setting); relaxed -- `llguidance-coerce` and `llguidance-lenient` (llguidance's
`coerce_one_of` and `lenient` x-guidance options: more schemas compile, some beyond the
spec). Compile time runs from the
schema to the first mask (the first fill included); each instance walks a fresh matcher at
the start state, as MaskBench's runner does: loom's `Grammar.copy()` of the compiled grammar,
a `deep_copy()` of llguidance's compiled `LLMatcher` (MaskBench's llg engine copies its
interpreter the same way), a new xgrammar `GrammarMatcher` of the compiled grammar.

Times are the process's CPU time by default (`--clock wall` for MaskBench's wall clock; see
use_clock). Each (engine, schema) pair runs in a worker process that is killed past its CPU-time budget;
workers are forked after the tokenizer is loaded and build their engines after the fork.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import signal
import sys
import time
from collections import Counter
from importlib.metadata import version
from multiprocessing.connection import wait

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# MaskBench's schema files (github.com/guidance-ai/jsonschemabench, maskbench/data): --data, or
# $LOOM_MASKBENCH_DATA, or a `shared/data/maskbench` folder beside the checkout
DATA = os.environ.get("LOOM_MASKBENCH_DATA") or os.path.join(
    ROOT, "..", "shared", "data", "maskbench"
)
ENGINES = (
    "loom", "loom-spec", "llguidance", "llguidance-coerce", "llguidance-lenient",
    "xgrammar", "xgrammar-nonstrict",
)  # fmt: skip
# Which JSON Schema rule each engine applies: a headline compares engines of one mode only.
#   strict:  an object admits only its listed keys, an array only its listed items
#            (xgrammar's strict_mode=True, MaskBench's default setting; loom's default)
#   spec:    JSON Schema's own rules (unlisted keys allowed unless additionalProperties says
#            otherwise): xgrammar strict_mode=False, llguidance's default, loom-spec
#   relaxed: beyond the spec to compile more: llguidance's coerce_one_of (oneOf as anyOf)
#            and lenient (unsupported keywords ignored) options
MODES = {
    "loom": "strict", "xgrammar": "strict",
    "loom-spec": "spec", "llguidance": "spec", "xgrammar-nonstrict": "spec",
    "llguidance-coerce": "relaxed", "llguidance-lenient": "relaxed",
}  # fmt: skip
LLG_OPTIONS = {"llguidance": {}, "llguidance-coerce": {"coerce_one_of": True},
               "llguidance-lenient": {"lenient": True}}  # fmt: skip
CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
_clock = CLOCKS["cpu"]


def use_clock(name: str) -> None:
    """Time compiles and mask steps with the process's CPU time ("cpu", the default) or the
    wall clock ("wall", MaskBench's). On an idle machine they agree; on a shared one the wall
    clock mostly measures waiting for a core, and CPU time still measures the engine's work.
    Set before the workers fork."""
    global _clock
    if name not in CLOCKS:
        raise SystemExit(f"--clock: expected one of {tuple(CLOCKS)}, got {name!r}")
    _clock = CLOCKS[name]


STATUSES = ("pass", "compile_error", "wrong_valid", "wrong_invalid", "timeout", "memory", "crash")


# --------------------------------------------------------------------------- tokenizers


def load_tokenizer(name: str):
    """(tokenizer, vocab_size, label) for `llama3`, `bundled` or a local HF tokenizer folder."""
    from transformers import AutoTokenizer

    if name == "llama3":
        sys.path.insert(0, ROOT)
        from tests.real_tokenizers import llama3_tokenizer_path

        path, label = llama3_tokenizer_path(), "Llama 3 (llama-models wheel)"
    elif name == "bundled":
        path, label = os.path.join(ROOT, "runtime", "bundled"), "loom's bundled model"
    elif os.path.isdir(name):
        path, label = name, name
    else:
        raise SystemExit(f"--tokenizer: expected llama3, bundled or a folder, got {name!r}")
    tok = AutoTokenizer.from_pretrained(path)
    vocab_size = max(len(tok), tok.vocab_size)
    return tok, vocab_size, f"{label}, {vocab_size:,} tokens"


# --------------------------------------------------------------------------- engines
# Each engine: compile(schema dict) -> compiled (first mask filled), and matcher(compiled) ->
# an object with step(t) -> bool (fill the mask, check t's bit, accept t if allowed) and
# eos_allowed() -> bool (fill the mask, check the EOS bit).


class _Bits:
    """A torch int32 bitmask [1, words] read through a numpy view (cheap per-token checks)."""

    def __init__(self, mask):
        self.mask, self.words = mask, mask.numpy()[0]

    def has(self, t: int) -> bool:
        return (int(self.words[t >> 5]) >> (t & 31)) & 1 == 1


class LoomEngine:
    def __init__(self, tok, vocab_size: int, spec_additional: bool, engine: str | None):
        from loom.grammar.backend import GrammarBackend
        from loom.grammar.base import allocate_token_bitmask
        from loom.grammar.json_schema import JsonSchemaOptions

        opts = JsonSchemaOptions(additional_properties_default=spec_additional)
        kw = {"engine": engine} if engine else {}
        self.backend = GrammarBackend(tok, vocab_size, json_options=opts, max_workers=1, **kw)
        self.bits = _Bits(allocate_token_bitmask(1, vocab_size))
        self.eos = sorted(self.backend.vocab.eos_token_ids)

    def compile(self, schema):
        g = self.backend.compile("json_schema", schema)
        g.fill_mask(self.bits.mask, 0)
        return g

    def matcher(self, compiled):
        return _LoomMatcher(compiled.copy(), self.bits, self.eos)


class _LoomMatcher:
    def __init__(self, g, bits, eos):
        self.g, self.bits, self.eos = g, bits, eos

    def step(self, t: int) -> bool:
        self.g.fill_mask(self.bits.mask, 0)
        if not self.bits.has(t):
            return False
        self.g.accept_token(t)
        return True

    def eos_allowed(self) -> bool:
        self.g.fill_mask(self.bits.mask, 0)
        return any(self.bits.has(e) for e in self.eos)


class LLGuidanceEngine:
    def __init__(self, tok, vocab_size: int, options: dict | None = None):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab_size)
        self.bits = _Bits(llguidance.torch.allocate_token_bitmask(1, vocab_size))
        self.eos = list(self.tok.eos_tokens)
        self.options = options or {}

    def compile(self, schema):
        if self.options and isinstance(schema, dict):  # llguidance reads them from the schema
            schema = {**schema, "x-guidance": {**schema.get("x-guidance", {}), **self.options}}
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema)
        m = self.llg.LLMatcher(self.tok, grammar)
        if m.is_error():
            raise ValueError(m.get_error())
        self.llg.torch.fill_next_token_bitmask(m, self.bits.mask, 0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def matcher(self, first):
        return _LLGMatcher(first.deep_copy(), self.llg.torch, self.bits, self.eos)


class _LLGMatcher:
    def __init__(self, m, llgt, bits, eos):
        self.m, self.fill, self.bits, self.eos = m, llgt.fill_next_token_bitmask, bits, eos

    def step(self, t: int) -> bool:
        self.fill(self.m, self.bits.mask, 0)
        return self.bits.has(t) and self.m.consume_token(t)

    def eos_allowed(self) -> bool:
        self.fill(self.m, self.bits.mask, 0)
        return any(self.bits.has(e) for e in self.eos)


class XGrammarEngine:
    def __init__(self, tok, vocab_size: int, strict: bool = True):
        import xgrammar as xgr

        self.xgr, self.strict = xgr, strict
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.bits = _Bits(xgr.allocate_token_bitmask(1, vocab_size))
        self.eos = list(info.stop_token_ids)

    def compile(self, schema):
        compiled = self.compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, strict_mode=self.strict
        )
        self.xgr.GrammarMatcher(compiled).fill_next_token_bitmask(self.bits.mask)
        return compiled

    def matcher(self, compiled):
        return _XGRMatcher(self.xgr.GrammarMatcher(compiled), self.bits, self.eos)


class _XGRMatcher:
    def __init__(self, m, bits, eos):
        self.m, self.bits, self.eos = m, bits, eos

    def step(self, t: int) -> bool:
        self.m.fill_next_token_bitmask(self.bits.mask)
        return self.bits.has(t) and self.m.accept_token(t)

    def eos_allowed(self) -> bool:
        self.m.fill_next_token_bitmask(self.bits.mask)
        return any(self.bits.has(e) for e in self.eos)


def make_engine(name: str, tok, vocab_size: int, loom_engine: str | None):
    if name in ("loom", "loom-spec"):
        return LoomEngine(tok, vocab_size, name == "loom-spec", loom_engine)
    if name in LLG_OPTIONS:
        return LLGuidanceEngine(tok, vocab_size, LLG_OPTIONS[name])
    if name in ("xgrammar", "xgrammar-nonstrict"):
        return XGrammarEngine(tok, vocab_size, strict=name == "xgrammar")
    raise SystemExit(f"--engines: unknown engine {name!r}; expected some of {ENGINES}")


def engine_label(name: str, loom_engine: str | None) -> str:
    if name.startswith("loom"):
        from loom.grammar.engines import DEFAULT_ENGINE

        return f"loom [{MODES[name]}] ({loom_engine or DEFAULT_ENGINE})"
    package, _, option = name.partition("-")
    return f"{package} {version(package)}{f' {option}' if option else ''} [{MODES[name]}]"


# --------------------------------------------------------------------------- one schema


def check_schema(engine, doc: dict, tok, max_valid: int | None = None) -> dict:
    """Compile and walk one MaskBench document with MaskBench's rules (module docstring).

    `max_valid`: walk only the first `max_valid` valid instances (bench_grammar's timing set).
    `walks` lists (instance index, accepted, steps) in the order of `mask_us`."""
    rec = {"status": "pass", "mask_us": [], "valid_rejected": 0, "invalid_accepted": 0}
    rec["valid_no_eos"], rec["walks"] = 0, []
    t0 = _clock()
    try:
        compiled = engine.compile(doc["schema"])
    except Exception as e:  # MaskBench: any exception while compiling is a compile error
        return {**rec, "status": "compile_error", "reason": f"{type(e).__name__}: {e}"[:300]}
    rec["compile_ms"] = 1e3 * (_clock() - t0)
    tests = list(enumerate(doc.get("tests", [])))
    if max_valid is not None:
        tests = [(i, t) for i, t in tests if t["valid"]][:max_valid]
    for i, test in tests:
        text = json.dumps(test["data"], ensure_ascii=False)
        ids = tok.encode(text, add_special_tokens=False)
        try:
            m = engine.matcher(compiled)
            before = len(rec["mask_us"])
            accepted = walk(m, ids, rec["mask_us"])
            rec["walks"].append((i, accepted, len(rec["mask_us"]) - before))
            if accepted and test["valid"] and not m.eos_allowed():  # untimed, off the verdict
                rec["valid_no_eos"] += 1
        except Exception as e:
            return {**rec, "status": "crash", "reason": f"test {i}: {type(e).__name__}: {e}"[:300]}
        if accepted != test["valid"]:
            key = "valid_rejected" if test["valid"] else "invalid_accepted"
            rec[key] += 1
            rec.setdefault("reason", f"test {i} ({'valid' if test['valid'] else 'invalid'}): "
                           f"{text[:200]}")  # fmt: skip
    if rec["invalid_accepted"]:
        rec["status"] = "wrong_invalid"
    elif rec["valid_rejected"]:
        rec["status"] = "wrong_valid"
    return rec


def walk(m, ids: list[int], mask_us: list[float]) -> bool:
    for t in ids:
        t0 = _clock()
        ok = m.step(t)
        mask_us.append(1e6 * (_clock() - t0))
        if not ok:
            return False
    return True


# --------------------------------------------------------------------------- worker pool


def _worker(conn, tok, vocab_size: int, loom_engine: str | None, max_valid, prebuild):
    os.environ["RAYON_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    # built before "ready", outside any schema's budget (at 128k an engine's tokenizer view
    # takes seconds; on a loaded machine the first schema of a fresh worker timed out)
    engines = {name: make_engine(name, tok, vocab_size, loom_engine) for name in prebuild}
    conn.send("ready")
    while True:
        task = conn.recv()
        if task is None:
            return
        name, path = task
        if name not in engines:
            engines[name] = make_engine(name, tok, vocab_size, loom_engine)
        with open(path) as f:
            doc = json.load(f)
        rec = check_schema(engines[name], doc, tok, max_valid)
        rec["rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        conn.send(rec)


class Pool:
    """Forked workers that run (engine, schema file) tasks under a CPU-time and an RSS budget.

    A worker over budget is killed and replaced; its task is reported as `timeout` (CPU time
    past `timeout`, or wall time past 4x that) or `memory` (resident set past `max_rss_gb`).
    `peak_rss_mb` is the largest resident set any of its workers reached (sampled by the parent
    every half second and reported by the worker itself after each task)."""

    def __init__(
        self, n, tok, vocab_size, loom_engine, timeout, max_rss_gb, max_valid=None, engines=()
    ):
        self.ctx = mp.get_context("fork")
        self.args = (tok, vocab_size, loom_engine, max_valid, tuple(engines))
        self.timeout, self.max_rss_kb = timeout, max_rss_gb * 1024 * 1024
        self.workers = [self._spawn() for _ in range(n)]
        self.peak_rss_mb = 0.0

    def _spawn(self):
        parent, child = self.ctx.Pipe()
        p = self.ctx.Process(target=_worker, args=(child, *self.args), daemon=True)
        p.start()
        assert parent.recv() == "ready"
        return parent, p

    def run(self, tasks, on_result) -> None:
        """tasks: [(engine, path)]; on_result(engine, path, rec) as each finishes."""
        todo, busy, idle = list(reversed(tasks)), {}, list(range(len(self.workers)))
        while todo or busy:
            while idle and todo:
                w = idle.pop()
                task = todo.pop()
                self.workers[w][0].send(task)
                busy[w] = (task, time.monotonic(), _cpu_seconds(self.workers[w][1].pid))
            ready = wait([self.workers[w][0] for w in busy], timeout=0.5)
            for w in list(busy):
                conn, proc = self.workers[w]
                task, started, cpu0 = busy[w]
                rss = _rss_kb(proc.pid)
                if conn in ready:
                    try:
                        rec = conn.recv()
                    except EOFError:
                        rec = self._replace(w, "crash")
                elif not proc.is_alive():
                    rec = self._replace(w, "crash")
                elif rss > self.max_rss_kb:
                    rec = self._replace(w, "memory")
                elif (
                    _cpu_seconds(proc.pid) - cpu0 > self.timeout
                    or time.monotonic() - started > 4 * self.timeout
                ):
                    rec = self._replace(w, "timeout")
                else:
                    self.peak_rss_mb = max(self.peak_rss_mb, rss / 1024)
                    continue
                self.peak_rss_mb = max(self.peak_rss_mb, rec.pop("rss_mb", 0.0), rss / 1024)
                del busy[w]
                idle.append(w)
                on_result(task[0], task[1], rec)

    def _replace(self, w: int, status: str) -> dict:
        conn, proc = self.workers[w]
        proc.kill()
        proc.join()
        self.workers[w] = self._spawn()
        return {"status": status, "mask_us": []}

    def close(self) -> None:
        for conn, p in self.workers:
            conn.send(None)
            p.join(timeout=5)
            if p.is_alive():
                p.kill()


def _cpu_seconds(pid: int) -> float:
    """A worker's CPU time: the budget counts the schema's own work, so a run that shares the
    machine does not time out schemas it merely starved."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return time.monotonic()  # no /proc: fall back to the wall clock


def _rss_kb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return float(line.split()[1])
    except OSError:
        pass
    return 0.0


def preload_loom() -> None:
    """Every grammar module is imported before forking, so one run measures one code version
    even if the files change while it runs."""
    import importlib
    import pkgutil

    import loom.grammar

    for m in pkgutil.walk_packages(loom.grammar.__path__, "loom.grammar."):
        importlib.import_module(m.name)


# --------------------------------------------------------------------------- report


def pct(xs, q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


def subset_of(file: str) -> str:
    return file.split("---")[0].split("_")[0]


def report(results: dict, engines: list[str], labels: dict, total: int) -> str:
    """results[engine][file] = rec. Every count is over the schemas that every engine has
    done, so a run cut short (or resumed with another engine added) still compares like for
    like."""
    common = set.intersection(*(set(results[e]) for e in engines)) if engines else set()
    w = max(len(labels[e]) for e in engines)
    head = f"{'engine':{w}s} " + " ".join(f"{s:>13s}" for s in STATUSES)
    head += f" {'valid_no_eos':>12s} {'compile p50':>11s} {'p99':>9s} {'mask p50':>9s} {'p99':>8s}"
    lines = [head]
    for e in engines:
        recs = [results[e][f] for f in common]
        c = Counter(r["status"] for r in recs)
        comp = [r["compile_ms"] for r in recs if "compile_ms" in r]
        mask = [x for r in recs for x in r["mask_us"]]
        row = f"{labels[e]:{w}s} " + " ".join(f"{c[s]:13d}" for s in STATUSES)
        row += f" {sum(r.get('valid_no_eos', 0) for r in recs):12d}"
        row += f" {pct(comp, 50):8.2f} ms {pct(comp, 99):6.0f} ms"
        row += f" {pct(mask, 50):6.1f} us {pct(mask, 99):5.0f} us"
        lines.append(row)
    lines.append(f"schemas: {len(common)} done by every engine, of {total} in the set")
    lines += headlines(results, engines, labels, common)
    lines.append("\npasses by subset: " + " / ".join(engines))
    for sub in sorted({subset_of(f) for f in common}):
        files = [f for f in common if subset_of(f) == sub]
        counts = [sum(results[e][f]["status"] == "pass" for f in files) for e in engines]
        lines.append(f"  {sub:14s} {len(files):5d}  " + " ".join(f"{x:6d}" for x in counts))
    return "\n".join(lines)


def headlines(results: dict, engines: list[str], labels: dict, files) -> list[str]:
    """Like against like: each loom engine's passes over each peer of the same mode."""
    out = []
    for ours in (e for e in engines if e.startswith("loom")):
        mine = sum(results[ours][f]["status"] == "pass" for f in files)
        for peer in (e for e in engines if not e.startswith("loom")):
            if MODES[peer] == MODES[ours]:
                theirs = sum(results[peer][f]["status"] == "pass" for f in files)
                out.append(f"headline [{MODES[ours]}]: {labels[ours]} {mine:,} pass vs "
                           f"{labels[peer]} {theirs:,}: {mine / max(theirs, 1):.2f}x")  # fmt: skip
    return out


def gaps(results: dict, data: str, ours: str, peers: list[str], top: int = 15) -> str:
    """Schemas a peer passes and `ours` fails: by status and by MaskBench feature, with ids."""
    lost = {
        f: r["status"]
        for f, r in results[ours].items()
        if r["status"] != "pass"
        and any(results[p].get(f, {}).get("status") == "pass" for p in peers)
    }
    unsound = sorted(f for f, r in results[ours].items() if r["status"] == "wrong_invalid")
    head = f"{ours} accepts an invalid instance of {len(unsound)} schemas: {', '.join(unsound)}\n"
    if not lost:
        return head + f"{ours}: no schema that {'/'.join(peers)} passes fails"
    by_feature: dict[str, list[str]] = {}
    for f in lost:
        with open(os.path.join(data, f)) as fh:
            feats = json.load(fh).get("meta", {}).get("features", [])
        for feat in feats or ["(none)"]:
            by_feature.setdefault(feat, []).append(f)
    lines = [head + f"{ours} fails {len(lost)} schemas that {'/'.join(peers)} pass(es); by status: "
             + ", ".join(f"{k} {v}" for k, v in Counter(lost.values()).most_common())]  # fmt: skip
    for feat, files in sorted(by_feature.items(), key=lambda kv: -len(kv[1]))[:top]:
        lines.append(f"  {feat:28s} {len(files):4d}  e.g. {', '.join(sorted(files)[:3])}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def select_files(args) -> list[str]:
    if not os.path.isdir(args.data):
        raise SystemExit(f"--data: no MaskBench folder at {args.data}")
    files = sorted(f for f in os.listdir(args.data) if f.endswith(".json"))
    if args.files:
        wanted = {line.strip() for line in open(args.files) if line.strip()}
        files = [f for f in files if f in wanted]
    files = files[:: args.stride]
    # interleave the subsets, so a run cut short is still a fair sample
    files = [f for i in range(50) for f in files[i::50]]
    return files[: args.limit]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--data", default=DATA)
    ap.add_argument("--tokenizer", default="llama3", help="llama3 (default), bundled, or a folder")
    ap.add_argument("--engines", default=",".join(ENGINES), help=f"comma list of {ENGINES}")
    ap.add_argument("--loom-engine", default=None, help="GrammarBackend(engine=...) for loom")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=30.0, help="CPU seconds per engine+schema")
    ap.add_argument("--max-rss-gb", type=float, default=6.0, help="kill a worker above this")
    ap.add_argument("--stride", type=int, default=1, help="every Kth schema file (sorted)")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--files", default=None, help="only the schema files named in this file")
    ap.add_argument("--out", default=None, help="one JSON line per (engine, schema)")
    ap.add_argument("--resume", action="store_true", help="skip pairs already in --out")
    ap.add_argument("--gaps", default="loom", help="list what this engine fails and peers pass")
    ap.add_argument("--clock", default="cpu", choices=tuple(CLOCKS), help="see use_clock")
    ap.add_argument("--report-only", action="store_true", help="report --out's records, run none")
    args = ap.parse_args()
    engines = [e for e in args.engines.split(",") if e]
    for e in engines:
        if e not in ENGINES:
            ap.error(f"--engines: unknown engine {e!r}; expected some of {ENGINES}")
    if args.workers < 1 or args.timeout <= 0:
        ap.error("--workers must be >= 1 and --timeout > 0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    use_clock(args.clock)
    files = select_files(args)
    tok, vocab_size, tok_label = load_tokenizer(args.tokenizer)
    if any(e.startswith("loom") for e in engines):
        preload_loom()
    labels = {e: engine_label(e, args.loom_engine) for e in engines}

    results: dict[str, dict] = {e: {} for e in engines}
    if args.report_only and not (args.out and os.path.exists(args.out)):
        ap.error("--report-only needs an existing --out file")
    if (args.resume or args.report_only) and args.out and os.path.exists(args.out):
        for line in open(args.out):
            r = json.loads(line)
            if r.get("engine") in results:
                results[r["engine"]][r["file"]] = r
    tasks = [(e, os.path.join(args.data, f)) for f in files for e in engines
             if f not in results[e]]  # fmt: skip
    if args.report_only:
        tasks = []
        results = {e: {f: r for f, r in results[e].items() if f in set(files)} for e in engines}
    sink = (
        open(args.out, "a" if args.resume else "w") if args.out and not args.report_only else None
    )
    done = [sum(len(v) for v in results.values())]
    t0, load0 = time.time(), os.getloadavg()

    def on_result(engine: str, path: str, rec: dict) -> None:
        rec["file"], rec["engine"] = os.path.basename(path), engine
        results[engine][rec["file"]] = rec
        if sink is not None:
            sink.write(json.dumps({**rec, "mask_us": [round(x, 1) for x in rec["mask_us"]]}) + "\n")
            sink.flush()
        done[0] += 1
        if done[0] % 500 == 0:
            passing = " ".join(
                f"{e} {sum(r['status'] == 'pass' for r in results[e].values())}" for e in engines
            )
            print(f"[{done[0]}/{len(files) * len(engines)}] pass: {passing}", flush=True)

    print(f"tokenizer: {tok_label}; {len(files)} schemas; engines: {', '.join(labels.values())}; "
          f"{args.clock} clock")  # fmt: skip
    pool = None
    if tasks:
        print(f"{args.workers} worker(s), {args.timeout:g} s CPU per engine+schema, "
              f"loadavg at start {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}", flush=True)  # fmt: skip
        pool = Pool(
            args.workers, tok, vocab_size, args.loom_engine, args.timeout, args.max_rss_gb,
            engines=engines,
        )  # fmt: skip
        signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
        try:
            pool.run(tasks, on_result)
        except KeyboardInterrupt:
            print("interrupted: reporting the pairs done so far", flush=True)
        finally:
            pool.close()
    if sink is not None:
        sink.close()
    print(report(results, engines, labels, len(files)))
    if args.gaps in engines:  # the peers of its own mode
        peers = [e for e in engines if not e.startswith("loom") and MODES[e] == MODES[args.gaps]]
        if peers:
            print(gaps(results, args.data, args.gaps, peers))
    if pool is not None:
        load = os.getloadavg()
        print(f"wall {time.time() - t0:.0f} s; loadavg at end {load[0]:.2f} {load[1]:.2f} "
              f"{load[2]:.2f}; peak worker RSS {pool.peak_rss_mb:.0f} MB (all engines in each "
              "worker)")  # fmt: skip


if __name__ == "__main__":
    main()
