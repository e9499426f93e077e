"""BFCL (the Berkeley Function Calling Leaderboard, `bfcl-eval`) on a loom server, through the
official `openai` client: refusals, schema-valid calls and BFCL's own AST checker accuracy.

Workload: the first --per-category questions (file order) of BFCL's simple_python, multiple,
parallel and parallel_multiple categories. Each question's function documents go through BFCL's
own OpenAI conversion (`convert_to_tool`: "." in names becomes "_", BFCL's types become JSON
schema's) and are sent as `tools`, the question's first turn as `messages`, greedy
(temperature 0), --max-tokens each, --concurrency requests in flight. Four modes per question:

  tool_choice   "auto" or "required"
  constrained   loom's call grammar on (the default) or off (`constrain_tools: false`: the
                same prompt and parser, free generation: what an engine without the grammar gets)

`parallel_tool_calls` is true on the parallel categories and false elsewhere (`--parallel
always|never` overrides): loom allows several calls only when a request says so.

Per mode and category: requests refused (HTTP 400, with the field and the schema feature
named), replies holding at least one call, replies whose every call is schema-valid
(`jsonschema`, format checking on, against the schema sent), BFCL AST accuracy
(`ast_checker`, the leaderboard's own), and finish_reason "length". Before sending, every
function document is also translated by loom's JSON-schema translation: documents it cannot
enforce are counted with their reasons (a non-strict tool falls back to "any JSON object").

bfcl-eval pins numpy==1.26.4, networkx and filelock versions that clash with loom's test
environment, so it is not a loom dependency; install it beside loom without its pins (the
checker and the converter need only these):

    pip install --no-deps bfcl-eval==2026.3.23 tree-sitter==0.21.3 tree-sitter-java==0.21.0 \\
        tree-sitter-javascript==0.21.4 tenacity
    python benchmarks/bench_bfcl.py [--model smollm2] [--url http://host:port] \\
        [--per-category 50] [--max-tokens 256] [--concurrency 8] [--json out.json]

bfcl_eval.constants.model_config imports every provider's SDK (anthropic, cohere, boto3, ...);
the AST checker reads it only to ask whether a model's names had "." replaced by "_", so this
benchmark puts a one-entry stand-in for that module in front of the import (our answer: yes,
as for BFCL's OpenAI models).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import types
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import commit, header, loadavg  # noqa: E402

CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple")
MODES = [(c, k) for k in (True, False) for c in ("required", "auto")]
MODEL_NAME = "loom"  # the checker's model name (see the stand-in below)


def import_bfcl():
    """BFCL's checker, converter and data folder (see the module docstring for the stand-in)."""
    try:
        import bfcl_eval
    except ImportError:
        sys.exit(
            "bfcl-eval is not installed: pip install --no-deps bfcl-eval==2026.3.23 "
            "tree-sitter==0.21.3 tree-sitter-java==0.21.0 tree-sitter-javascript==0.21.4 tenacity"
        )
    config = types.ModuleType("bfcl_eval.constants.model_config")
    config.MODEL_CONFIG_MAPPING = {MODEL_NAME: types.SimpleNamespace(underscore_to_dot=True)}
    sys.modules.setdefault("bfcl_eval.constants.model_config", config)
    from bfcl_eval.constants.enums import Language, ModelStyle
    from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI
    from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker
    from bfcl_eval.model_handler.utils import convert_to_tool

    def to_tools(functions):
        return convert_to_tool(functions, GORILLA_TO_OPENAPI, ModelStyle.OPENAI_COMPLETIONS)

    def check(functions, calls, answer, category):
        return ast_checker(functions, calls, answer, Language.PYTHON, category, MODEL_NAME)

    return Path(bfcl_eval.__file__).parent / "data", to_tools, check


def load(data: Path, category: str, n: int) -> list[dict]:
    def rows(path: Path) -> list[dict]:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    qs = rows(data / f"BFCL_v4_{category}.json")[:n]
    answers = {
        r["id"]: r["ground_truth"]
        for r in rows(data / "possible_answer" / f"BFCL_v4_{category}.json")
    }
    for q in qs:
        q["answer"] = answers[q["id"]]
    return qs


def enforceable(schema: dict) -> str | None:
    """None when loom's JSON-schema translation enforces `schema`, else its reason."""
    from loom.grammar.base import GrammarError
    from loom.runtime.server import tools as T

    try:
        T.schema_regex(schema)
    except GrammarError as e:
        return str(e)
    return None


def schema_valid(calls: list, tools: dict[str, dict]) -> bool:
    import jsonschema

    for c in calls:
        schema = tools.get(c.function.name)
        if schema is None:
            return False
        try:
            args = json.loads(c.function.arguments)
            jsonschema.validate(args, schema, format_checker=jsonschema.FormatChecker())
        except (ValueError, jsonschema.ValidationError, jsonschema.SchemaError):
            return False
    return True


def ask(
    client,
    model: str,
    q: dict,
    tools: list[dict],
    choice: str,
    constrained: bool,
    parallel: bool,
    max_tokens: int,
) -> dict:
    import openai

    t0 = time.perf_counter()
    try:
        r = client.chat.completions.create(
            model=model,
            messages=q["question"][0],
            tools=[{"type": "function", "function": t} for t in tools],
            tool_choice=choice,
            parallel_tool_calls=parallel,
            temperature=0,
            max_tokens=max_tokens,
            extra_body={"constrain_tools": constrained},
        )
    except openai.BadRequestError as e:
        return {"refused": str(e.message), "seconds": time.perf_counter() - t0}
    c = r.choices[0]
    return {
        "calls": c.message.tool_calls or [],
        "content": c.message.content,
        "finish": c.finish_reason,
        "seconds": time.perf_counter() - t0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--url", help="an already running loom server (else one is started)")
    ap.add_argument("--per-category", type=int, default=50)
    ap.add_argument("--categories", default=",".join(CATEGORIES))
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--parallel", choices=("category", "always", "never"), default="category")
    ap.add_argument("--json", help="write every reply's outcome here")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args()
    data, to_tools, check = import_bfcl()
    cats = args.categories.split(",")
    questions = {c: load(data, c, args.per_category) for c in cats}

    # every function document through loom's translation first (a reason for each one it
    # cannot enforce)
    docs, reasons = 0, Counter()
    for qs in questions.values():
        for q in qs:
            # already {"type": "function", "function": {...}} (BFCL's OpenAI chat style)
            q["tools"] = [t["function"] for t in to_tools(q["function"])]
            for t in q["tools"]:
                docs += 1
                why = enforceable(t["parameters"])
                if why is not None:
                    reasons[why] += 1

    import openai

    runtime = None
    url = args.url
    if url is None:
        from loom.runtime.gguf.named import resolve_model_name
        from loom.runtime.server.runtime_client import Runtime

        t0 = time.perf_counter()
        path = resolve_model_name(args.model)
        runtime = Runtime(path, max_total_tokens=32768, served_model_name=args.model)
        runtime.__enter__()
        url = runtime.url
        print(f"server up in {time.perf_counter() - t0:.0f} s ({loadavg()})")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=1800)
        model = client.models.list().data[0].id
        started = time.perf_counter()
        jobs = []
        for cat in cats:
            par = {"category": "parallel" in cat, "always": True, "never": False}[args.parallel]
            for q in questions[cat]:
                for choice, constrained in MODES:
                    jobs.append((cat, q, choice, constrained, par))
        with ThreadPoolExecutor(args.concurrency) as pool:
            outs = list(
                pool.map(
                    lambda j: ask(
                        client, model, j[1], j[1]["tools"], j[2], j[3], j[4], args.max_tokens
                    ),
                    jobs,
                )
            )
        wall = time.perf_counter() - started
    finally:
        if runtime is not None:
            runtime.__exit__(None, None, None)

    rows: dict[tuple, Counter] = {}
    refusals: Counter = Counter()
    records = []
    for (cat, q, choice, constrained, par), out in zip(jobs, outs):
        row = rows.setdefault((cat, choice, constrained), Counter())
        row["n"] += 1
        rec = {
            "id": q["id"],
            "category": cat,
            "tool_choice": choice,
            "constrained": constrained,
            "parallel_tool_calls": par,
        }
        if "refused" in out:
            row["refused"] += 1
            refusals[out["refused"]] += 1
            records.append({**rec, "refused": out["refused"]})
            continue
        calls = out["calls"]
        schemas = {t["name"]: t["parameters"] for t in q["tools"]}
        valid = bool(calls) and schema_valid(calls, schemas)
        ok = False
        if valid:
            model_output = [{c.function.name: json.loads(c.function.arguments)} for c in calls]
            result = check(q["function"], model_output, q["answer"], cat)
            ok = bool(result["valid"])
        row["called"] += bool(calls)
        row["valid"] += valid
        row["ast"] += ok
        row["length"] += out["finish"] == "length"
        records.append(
            {
                **rec,
                "finish": out["finish"],
                "valid": valid,
                "ast": ok,
                "content": out["content"],
                "calls": [(c.function.name, c.function.arguments) for c in calls],
            }
        )

    print(header("BFCL on loom"))
    print(
        f"model {args.model}, {args.per_category} per category, max_tokens {args.max_tokens}, "
        f"temperature 0, concurrency {args.concurrency}, parallel_tool_calls {args.parallel}, "
        f"{len(jobs)} requests in {wall:.0f} s"
    )
    print(
        f"function documents: {docs}; not enforceable by loom's translation: "
        f"{sum(reasons.values())}"
    )
    for why, n in reasons.most_common():
        print(f"  {n} x {why}")
    print(f"refused (HTTP 400): {sum(refusals.values())}")
    for why, n in refusals.most_common():
        print(f"  {n} x {why}")
    print()
    print(
        "| category | tool_choice | grammar | n | refused | with a call | schema-valid | "
        "BFCL AST | finish length |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for (cat, choice, constrained), r in rows.items():
        n = r["n"]
        print(
            f"| {cat} | {choice} | {'on' if constrained else 'off'} | {n} | {r['refused']} | "
            f"{r['called']} | {r['valid']} | {r['ast']}/{n} ({100 * r['ast'] / n:.0f}%) | "
            f"{r['length']} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    if not args.no_plot:
        plot_rows(rows, cats, args)


def plot_rows(rows: dict, cats: list[str], args) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot written")
        return
    from benchmarks.common import IMG_DIR, REPO

    fig, ax = plt.subplots(figsize=(7.2, 4.0), dpi=110)
    width = 0.2
    for i, (choice, constrained) in enumerate(MODES):
        ys = [
            100 * rows[(c, choice, constrained)]["ast"] / rows[(c, choice, constrained)]["n"]
            for c in cats
        ]
        label = f"{choice}, grammar {'on' if constrained else 'off'}"
        ax.bar([k + (i - 1.5) * width for k in range(len(cats))], ys, width, label=label)
    ax.set_xticks(range(len(cats)), cats)
    ax.set_ylabel("BFCL AST accuracy (%)")
    ax.set_ylim(0, 100)
    ax.set_title(
        f"BFCL on loom serve --model {args.model} ({args.per_category} per category)", fontsize=10
    )
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    ax.text(
        0.99, 0.97, f"commit {commit()}", transform=ax.transAxes, fontsize=6, ha="right", va="top"
    )
    fig.tight_layout()
    IMG_DIR.mkdir(parents=True, exist_ok=True)
    out = IMG_DIR / f"bfcl_{args.model}.png"
    fig.savefig(out)
    plt.close(fig)
    print(f"plot {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
