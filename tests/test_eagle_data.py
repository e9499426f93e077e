"""eagle_data: self-distilled EAGLE-3 data through in-process schedulers (the serving path).

On the tiny llama: the greedy answers are the target's greedy continuations
(`greedy_generate`, a whole-sequence pass per token), the features of one capturing prefill
(the C forward's `ForwardOutput.hidden`) equal the eager whole-sequence pass training used
(`target_pass`) within bf16 rounding, the labels are its greedy tokens at every position, and
shards round-trip into what `eagle_features.train` reads."""

from __future__ import annotations

import random

import pytest
import torch

from loom.runtime.model_loader import load_config, load_model
from loom.runtime.spec import eagle_features as ef
from loom.runtime.spec.eagle_data import Distiller, check_against_eager, load_shards, write_shard
from loom.runtime.spec.eagle_unroll import target_pass
from loom.runtime.spec.head_training import greedy_generate

CAPTURE = (0, 1, 1)


@pytest.fixture(scope="module")
def setup(llama):
    model = load_model(llama, torch.float32, "cpu", load_config(llama))
    d = Distiller(llama, llama, CAPTURE, batch=8, threads=1, max_len=256)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randrange(4, 12))] for _ in range(6)]
    return model, d, prompts


def test_answers_are_the_targets_greedy_continuations(setup):
    model, d, prompts = setup
    answers = d.generate(prompts, 16)
    with torch.no_grad():
        for p, a in zip(prompts, answers):
            assert p + a == greedy_generate(model, p, len(a), set())


def test_prefill_features_and_labels_match_the_eager_pass(setup):
    model, d, prompts = setup
    answers = d.generate(prompts, 16)
    for p, a in zip(prompts, answers):
        doc = p + a
        feats, argmax = d.features(doc)
        assert feats.dtype == torch.bfloat16 and feats.shape[0] == len(doc)
        with torch.no_grad():
            logits, want = target_pass(model, torch.tensor([doc]), CAPTURE)
        # every position, the first included (the tiny model has no attention sink)
        torch.testing.assert_close(feats.float(), want[0], rtol=1e-2, atol=1e-2)
        assert argmax.tolist() == logits[0].argmax(-1).tolist()
        # self-distilled: the answer is the target's greedy next token at each position
        assert a == argmax[len(p) - 1 : -1].tolist()
        errs, agree = check_against_eager(model, CAPTURE, doc, feats, argmax)
        assert max(errs) < 5e-3 and agree == 1.0, (errs, agree)


def test_shards_round_trip_into_training_records(setup, tmp_path):
    model, d, prompts = setup
    answers = d.generate(prompts, 12)
    paths = []
    for k, (ps, ans) in enumerate(((prompts[:3], answers[:3]), (prompts[3:], answers[3:]))):
        rec = {"ids": [], "start": [], "feats": [], "argmax": [], "capture": list(CAPTURE),
               "prompts": []}  # fmt: skip
        for p, a in zip(ps, ans):
            feats, argmax = d.features(p + a)
            rec["ids"].append(torch.tensor(p + a, dtype=torch.int32))
            rec["start"].append(len(p))
            rec["feats"].append(feats)
            rec["argmax"].append(argmax)
            rec["prompts"].append(str(p))
        paths.append(tmp_path / f"{k:06d}.pt")
        write_shard(paths[-1], rec)
    recs = load_shards(paths)
    assert [r.tolist() for r in recs["ids"]] == [p + a for p, a in zip(prompts, answers)]
    assert recs["start"] == [len(p) for p in prompts] and recs["capture"] == list(CAPTURE)
    # what eagle_features.train reads: one padded batch of all six documents
    t2d = torch.arange(model.config.vocab_size)
    ids, next_ids, feats, labels, answer = ef._batch(recs, list(range(6)), t2d)
    assert ids.shape[0] == 6 and feats.shape[-1] == recs["feats"][0].shape[-1]
    bad = dict(recs, capture=[1, 1, 1])
    write_shard(tmp_path / "bad.pt", bad)
    with pytest.raises(ValueError, match="holds layers"):
        load_shards([paths[0], tmp_path / "bad.pt"])
