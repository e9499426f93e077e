"""Tool-call validity and latency on /v1/chat/completions, with and without the constrained call.

Workload: --requests chat requests (one user turn, two tools: get_weather {city, unit enum},
calculator {a, op enum, b}), temperature 1, --max-tokens each, sent one at a time through the
official `openai` client to a loom server on --model. Rows:

  constrained    tool_choice="required": the reply is generated under the grammar of the tools'
                 calls (loom's tool_regex), then parsed
  unconstrained  tool_choice="none": the same prompt (tools rendered), free generation; the
                 reply is parsed with the same parser (what a server without the grammar gets)

A call is valid when the reply holds at least one call, every call names a tool and its
arguments parse as JSON and validate against the tool's schema (jsonschema); a constrained
reply can only be invalid when max_tokens cuts it off (the schemas leave integers unbounded,
so a random model may write digits until the budget ends), which the table counts. Default model:
`random-bundled`, the bundled model's architecture and tokenizer with random weights (built
into the benchmark cache), so validity comes from the grammar alone.

    python benchmarks/bench_tools.py [--model random-bundled|bundled|<folder>] [--requests 50]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import MODEL_CACHE, header, resolve_model  # noqa: E402

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 16},
                    "unit": {"enum": ["c", "f"]},
                },
                "required": ["city", "unit"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Integer arithmetic",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer"},
                    "op": {"enum": ["+", "-", "*"]},
                    "b": {"type": "integer"},
                },
                "required": ["a", "op", "b"],
            },
        },
    },
]
QUESTIONS = ["What's the weather in Tokyo?", "What is 12 times 7?", "Weather in Oslo in F?"]


def random_bundled() -> str:
    """The bundled model's config and tokenizer with freshly initialised weights."""
    import torch
    import transformers

    from loom.runtime.server_args import BUNDLED_MODEL_PATH

    path = MODEL_CACHE / "random-bundled"
    if not (path / "model.safetensors").exists():
        path.mkdir(parents=True, exist_ok=True)
        for f in Path(BUNDLED_MODEL_PATH).iterdir():
            if f.name != "model.safetensors" and f.is_file():
                shutil.copy(f, path / f.name)
        torch.manual_seed(0)
        config = transformers.AutoConfig.from_pretrained(BUNDLED_MODEL_PATH)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


def valid(text_or_calls, fmt) -> bool:
    import jsonschema

    from loom.runtime.server.tools import ToolCallParser, assemble

    if isinstance(text_or_calls, str):
        parser = ToolCallParser(fmt)
        _, calls = assemble(parser.feed(text_or_calls) + parser.finish())
    else:
        calls = [c.model_dump() for c in text_or_calls or []]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    if not calls:
        return False
    for c in calls:
        name, args = c["function"]["name"], c["function"]["arguments"]
        try:
            jsonschema.validate(json.loads(args), schemas[name])
        except (KeyError, ValueError, jsonschema.ValidationError):
            return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="random-bundled")
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    import openai

    from loom.runtime.server.runtime_client import Runtime
    from loom.runtime.server.tools import FORMATS

    label, path = (
        ("random-bundled", random_bundled())
        if args.model == "random-bundled"
        else resolve_model(args.model)
    )
    rows = []
    with Runtime(path, max_total_tokens=16384, served_model_name="m") as rt:
        client = openai.OpenAI(base_url=rt.url + "/v1", api_key="x", max_retries=0, timeout=600)
        fmt = FORMATS["qwen25"]
        for mode in ("constrained", "unconstrained"):
            ok, cut, lat, toks = 0, 0, [], []
            for i in range(args.requests):
                start = time.perf_counter()
                r = client.chat.completions.create(
                    model="m",
                    messages=[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                    tools=TOOLS,
                    tool_choice="required" if mode == "constrained" else "none",
                    temperature=1.0,
                    seed=i,
                    max_tokens=args.max_tokens,
                )
                lat.append(time.perf_counter() - start)
                toks.append(r.usage.completion_tokens)
                msg = r.choices[0].message
                cut += r.choices[0].finish_reason == "length"
                ok += valid(msg.tool_calls if mode == "constrained" else msg.content or "", fmt)
            rows.append((mode, ok, cut, statistics.median(lat), statistics.mean(toks), sum(lat)))
    print(header(f"bench_tools ({label}, {args.requests} requests, max_tokens {args.max_tokens})"))
    print(
        "| mode | valid calls | cut by max_tokens | median latency (s) "
        "| mean completion tokens | ms / token |"
    )
    print("|---|---|---|---|---|---|")
    for mode, ok, cut, med, mean_toks, total in rows:
        per_tok = 1000 * total / max(1.0, mean_toks * args.requests)
        print(
            f"| {mode} | {ok}/{args.requests} ({100 * ok / args.requests:.0f}%) | {cut} | {med:.3f} "
            f"| {mean_toks:.1f} | {per_tok:.1f} |"
        )


if __name__ == "__main__":
    main()
