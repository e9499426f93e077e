"""The scheduler's tokenizer of a GGUF file (runtime/gguf/vocab.py): decoding from the file's
vocabulary equals the tokenizer's on every token and on random runs (byte tokens, special
tokens, skipped or not), the EOS ids equal runtime/tokenizer.eos_token_ids', and a scheduler
serving plain and stop-string requests never builds the tokenizer, which the first
constrained request does (on the grammar backend's thread)."""

from __future__ import annotations

import random

import pytest

from loom.runtime.gguf.vocab import LazyTokenizer, VocabDecoder, eos_ids
from loom.runtime.tokenizer import eos_token_ids


@pytest.mark.parametrize("name", ["smollm2", "gemma3-270m"])
def test_vocab_decoder_equals_the_tokenizer(real_gguf, gguf_tokenizer, name):
    path = real_gguf(name)
    dec, tok = VocabDecoder(path), gguf_tokenizer(path)
    n = dec.vocab_size
    assert eos_ids(path) == eos_token_ids(path, tok)
    for skip in (False, True):
        got = [dec.decode([i], skip) for i in range(n)]
        want = tok.batch_decode([[i] for i in range(n)], skip_special_tokens=skip)
        assert got == want
    rng = random.Random(0)
    byte_ids = [i for i in range(n) if dec.byte[i] >= 0] or list(range(n))
    special = [i for i in range(n) if dec.special[i]]
    assert special  # both files have CONTROL tokens (<|im_start|>, <start_of_turn>, ...)
    runs = []
    for _ in range(2000):
        pool = rng.choice([range(n), byte_ids, special])
        runs.append(
            [
                rng.choice(pool) if rng.random() < 0.6 else rng.randrange(n)
                for _ in range(rng.randint(1, 24))
            ]
        )
    runs.append(
        tok.encode("Grüße, 東京! 🙂 <start_of_turn>model\n  x\ty", add_special_tokens=False)
    )
    for skip in (False, True):
        want = tok.batch_decode(runs, skip_special_tokens=skip)
        assert [dec.decode(r, skip) for r in runs] == want


def test_scheduler_builds_the_tokenizer_only_for_a_constrained_request(real_gguf, gguf_tokenizer):
    """A GGUF scheduler keeps the lazy tokenizer: a plain request and a stop-string one (the
    stop matched in the decoded tail) leave it unbuilt; the first JSON-schema request builds
    it, and the answer is valid JSON."""
    import json

    from loom.runtime.scheduler.scheduler import Scheduler
    from loom.runtime.server_args import ServerArgs
    from tests.runtime_helpers import submit

    def run_all(sched):  # the ids and finish reason (no Detokenizer: it would build it)
        out: dict[str, tuple[list[int], dict | None]] = {}
        while not sched.is_idle:
            for o in sched.step():
                ids, _ = out.get(o.rid, ([], None))
                out[o.rid] = (ids + list(o.new_ids), o.finished_reason)
        return out

    path = real_gguf("smollm2")
    sched = Scheduler(ServerArgs(model_path=path, quantization="gguf", max_total_tokens=2048))
    tok = sched.tokenizer
    assert isinstance(tok, LazyTokenizer) and not tok.loaded
    assert sched.eos_token_ids == frozenset(eos_token_ids(path, gguf_tokenizer(path)))
    ids = gguf_tokenizer(path).encode("Count: one, two, three, four, five, six")
    submit(sched, "plain", ids, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
    out, _ = run_all(sched)["plain"]
    text = tok.decode(out)
    stop = text[len(text) // 2 :][:3]
    assert stop.strip()
    submit(sched, "stop", ids, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True,
                                "stop": [stop]})  # fmt: skip
    got, reason = run_all(sched)["stop"]
    assert reason == {"type": "stop", "matched": stop} and len(got) < 8 and not tok.loaded
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    submit(sched, "json", ids, {"max_new_tokens": 24, "temperature": 0,
                                "json_schema": json.dumps(schema)})  # fmt: skip
    answer, _ = run_all(sched)["json"]
    assert tok.loaded
    assert isinstance(json.loads(tok.decode(answer, skip_special_tokens=True))["n"], int)
