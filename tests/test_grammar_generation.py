"""Constrained generation on MaskBench schemas, in the worst case, at two vocabularies.

A tiny random-weight model samples at temperature 1.0, so it wants garbage at every step and
only the grammar mask keeps the text in the schema's language. Two models: the toy one
(tests/tiny_models.py: byte-level BPE of 320 ids, model vocabulary padded to 384) and one
whose vocabulary is Llama 3's real tokenizer (128,256 rows; hidden size 32, one layer, so the
128k-wide embedding is the only large weight). Both run the default engine
(`--grammar-backend llguidance`). All schemas are submitted at once to an in-process
scheduler, so they go through the real path: grammar queue and compile workers, one packed
bitmask for the batch in the sampler, grammar advance and jump-forward.

The subset: every 43rd (toy) / 113th (llama3) file of MaskBench in sorted order (spread through
the sorted list), vendored in tests/data. A schema that does not compile (GrammarError: the request finishes
with a 400 abort) is counted, not failed: compile coverage is measured by test_maskbench.py
and benchmarks/maskbench_coverage.py. At least COMPILED_FLOOR of the subset must compile, so
this cannot pass vacuously.

Every compiled schema must give a complete document (finish reason "stop"): json.loads, then
valid under jsonschema's validator for the schema's $schema. Why a logit bias: a random model
closes a free-form string only when it happens to pick one of the few quote tokens among the
~300 the toy mask allows (~120k at 128k), so a string runs ~150 tokens and a schema with a
few required strings does not end within the 1,024-token context (measured: 4 of 40 schemas
capped at 512 tokens, with strings of 100-500 characters). The translator has no option that
bounds free strings (JsonSchemaOptions bounds whitespace, free-form nesting and huge repeats,
not this), and a grammar change would be testing a different language. Numbers (digit after
digit), arrays and optional properties run long the same way. So each request carries a
logit bias of CLOSE_BIAS[vocab] on the closing tokens CLOSERS[vocab], a stand-in for a real
model's wish to finish what it opened. Everything else (which property, enum member, digit,
escape, whether to go on) stays the random model's choice at T=1.0, and the bias is applied
before the mask, so it can only move probability among tokens the grammar allows. What still
cannot end: a `pattern` that needs a word somewhere in the string (e.g. "wifi", unanchored)
which a random model never types; such requests hit max_new_tokens, as do a few very large
documents. They are printed, and at most MAX_CAPPED[vocab] may (about 3% of the compiled).
"""

from __future__ import annotations

import gc
import json
import os
import time
from collections import Counter

import pytest
import torch

from tests.maskbench_data import DATA, subset
from tests.runtime_helpers import make_scheduler, run_all, submit

# every 43rd / 113th file of the full corpus: 263 / 101 schemas
COMPILED_FLOOR = 0.80  # measured 233 of 259 (0.90) with the tiny model's tokenizer
CLOSE_BIAS = {"toy": 4.0, "llama3": 9.0}
# at 128k a number has ~1,100 digit-group tokens to go on with: "," ends it as often as "}"
CLOSERS = {"toy": ('"', '",', "}", "]"), "llama3": ('"', '",', "}", "]", ",")}
MAX_NEW_TOKENS = 900  # the tiny models' context is 1,024
MAX_CAPPED = {"toy": 8, "llama3": 4}  # toy measured 6: 2 needle patterns, long numbers
PROMPT = [5, 6, 7, 8, 9]


def _subset(vocab: str) -> list[str]:
    return subset(f"generation_{vocab}")


@pytest.fixture(scope="module")
def llama3_vocab_model(tmp_path_factory) -> str:
    """A random Llama checkpoint whose vocabulary is Llama 3's tokenizer (128,256 ids)."""
    from tests.tiny_models import build_llama3_vocab_model

    return build_llama3_vocab_model(tmp_path_factory.mktemp("llama3_vocab_model"))


@pytest.fixture
def one_thread():
    """The CPU is shared: torch's default thread pool spins against the other processes and
    made each tiny matmul ~40x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("vocab", ["toy", "llama3"])
def test_maskbench_schemas_generate_valid_documents(vocab, tiny_model_dir, request, one_thread):
    from jsonschema.validators import validator_for

    t0 = time.perf_counter()
    if vocab == "toy":
        path = tiny_model_dir("llama")
    else:
        path = request.getfixturevalue("llama3_vocab_model")
    sched = make_scheduler(path, max_total_tokens=65536, grammar_compile_timeout=60)
    sched.check_integrity_every_step = False  # checked once when idle (run_all)
    tok = sched.tokenizer
    closing = [tok.convert_tokens_to_ids(t) for t in CLOSERS[vocab]]
    assert all(isinstance(t, int) and t >= 0 for t in closing), closing
    bias = {t: CLOSE_BIAS[vocab] for t in closing}
    if vocab == "toy":
        assert sched.vocab_size > len(tok)  # the model vocabulary is padded past the tokenizer's
    else:
        assert sched.vocab_size == len(tok) == 128_256
    assert sched.grammar_queue.backend.engine_name == "llguidance"
    subset = _subset(vocab)
    schemas = {}
    for i, name in enumerate(subset):
        with open(os.path.join(DATA, name)) as f:
            schemas[name] = json.load(f)["schema"]
        params = {
            "temperature": 1.0,
            "max_new_tokens": MAX_NEW_TOKENS,
            "json_schema": json.dumps(schemas[name]),
            "logit_bias": bias,
        }
        submit(sched, name, PROMPT, params, seed=i)
    results = run_all(sched)
    sched.grammar_queue.backend.shutdown()

    status: Counter = Counter()
    capped, invalid = [], []
    for name in subset:
        r = results[name]
        kind = r.finish_reason["type"]
        if kind == "abort":
            assert r.finish_reason.get("status_code") == 400, (name, r.finish_reason)
            assert r.finish_reason["message"], name
            status["compile_error"] += 1
            continue
        status["compiled"] += 1
        if kind == "length":
            capped.append(f"{name}: {len(r.ids)} tokens: {r.text[:80]!r}...")
            continue
        assert kind == "stop", (name, r.finish_reason)
        try:
            doc = json.loads(r.text)
        except json.JSONDecodeError as e:
            invalid.append(f"{name}: not JSON ({e}): {r.text[:200]!r}")
            continue
        schema = schemas[name]
        error = next(validator_for(schema)(schema).iter_errors(doc), None)
        if error is not None:
            invalid.append(f"{name}: {error.message[:160]} in {r.text[:200]!r}")
            continue
        status["valid"] += 1
    del sched, results
    gc.collect()
    print(
        f"\nmaskbench generation ({vocab}): {len(subset)} schemas, {status['compiled']} compiled, "
        f"{status['valid']} valid, {len(capped)} length-capped, {len(invalid)} invalid, "
        f"{status['compile_error']} compile errors; {time.perf_counter() - t0:.0f} s"
    )
    print("\n".join(capped))
    assert not invalid, "\n".join(invalid)
    assert len(capped) <= MAX_CAPPED[vocab], "did not terminate:\n" + "\n".join(capped)
    assert status["compiled"] >= COMPILED_FLOOR * len(subset), status
    assert status["valid"] == status["compiled"] - len(capped)
