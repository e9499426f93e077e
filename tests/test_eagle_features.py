"""eagle_features: an EAGLE-3 head trained over the target's features computed once.

On the tiny llama with self-distilled documents (prompt + the target's own greedy
continuation): the stored features and greedy tokens are the target's (a whole-sequence pass),
training over them raises held-out top-1 and the accepted length, and the saved head loads
for serving and drafts the same tokens as the head in memory."""

from __future__ import annotations

import random

import pytest
import torch

from loom.runtime.model_loader import load_config, load_model
from loom.runtime.spec import eagle_features as ef
from loom.runtime.spec.eagle import build_eagle_head, head_config, load_eagle_head
from loom.runtime.spec.eagle_unroll import target_pass, unroll
from loom.runtime.spec.head_training import greedy_generate
from loom.runtime.spec.train_eagle import accepted_length, init_head

CAPTURE = (0, 1, 1)


@pytest.fixture(scope="module")
def setup(llama, tmp_path_factory):
    torch.manual_seed(0)
    model = load_model(llama, torch.float32, "cpu", load_config(llama))
    for p in model.parameters():
        p.requires_grad_(False)
    rng = random.Random(0)
    docs = []
    with torch.no_grad():
        for _ in range(40):
            prompt = [rng.randrange(3, 200) for _ in range(rng.randrange(4, 9))]
            docs.append((greedy_generate(model, prompt, 24, set()), len(prompt)))
    path = tmp_path_factory.mktemp("feats") / "features.pt"
    ef.precompute(model, docs, CAPTURE, path, progress=False)
    return model, docs, torch.load(path, weights_only=False)


def test_stored_features_are_the_targets(setup):
    model, docs, recs = setup
    assert recs["capture"] == list(CAPTURE) and len(recs["ids"]) == len(docs)
    for (ids, start), i in zip(docs[:5], range(5)):
        with torch.no_grad():
            logits, feats = target_pass(model, torch.tensor([ids]), CAPTURE)
        assert recs["ids"][i].tolist() == ids and recs["start"][i] == start
        assert recs["feats"][i].dtype == torch.bfloat16
        torch.testing.assert_close(recs["feats"][i].float(), feats[0], rtol=1e-2, atol=1e-2)
        assert recs["argmax"][i].tolist() == logits[0].argmax(-1).tolist()
        # self-distilled: the answer is the target's greedy continuation
        assert ids[start:] == recs["argmax"][i][start - 1 : -1].tolist()


def test_training_over_features_raises_acceptance_and_saves_a_loadable_head(setup, tmp_path):
    model, docs, recs = setup
    train_idx, hold_idx = list(range(32)), list(range(32, 40))
    draft = ef.choose_draft_vocab({"argmax": [recs["argmax"][i] for i in train_idx]}, 64)
    t2d = torch.full((model.config.vocab_size,), -100, dtype=torch.long)
    t2d[draft] = torch.arange(draft.numel())
    hcfg = head_config(model.config, "eagle3", draft_vocab_size=draft.numel(),
                       eagle_config={"eagle_aux_hidden_state_layer_ids": list(CAPTURE)},
                       target_hidden_size=model.config.hidden_size)  # fmt: skip
    head = build_eagle_head(hcfg, model, torch.float32, "cpu")
    head.d2t.copy_(draft - torch.arange(draft.numel()))
    init_head(head, model, "eagle3", 0)
    for p in head.parameters():
        p.requires_grad_(True)
    out = tmp_path / "head"
    logs: list[str] = []

    def save(h, rec):
        from loom.runtime.spec.eagle import save_eagle_head

        save_eagle_head(h, out)

    seen = train_idx[:8]
    before = ef.evaluate(head, recs, seen, t2d, 3)
    scale = ef.feature_scale(recs, train_idx)
    history = ef.train(head, recs, train_idx, hold_idx, t2d, epochs=6, unroll_steps=2,
                       eval_steps=3, tokens_per_batch=128, lr=3e-3, max_minutes=None,
                       save=save, log=logs.append, scale=scale)  # fmt: skip
    assert len(history) == 7 and "untrained" in logs[0] and "epoch 6" in logs[-1]
    assert all(h["accept_length"] >= 1.0 and len(h["heldout_top1"]) == 3 for h in history)
    # it learns the documents it trains on: top-1 at every draft step and the accepted length
    after = ef.evaluate(head, recs, seen, t2d, 3, scale)
    assert all(a > b for a, b in zip(after[0], before[0])), (before, after)
    assert after[1] > before[1]
    # the saved head (fc folded back to raw features): its accepted length by train_eagle's
    # estimate, which runs the target afresh (f32 features), equals the one along the cached
    # answers up to bf16 rounding of the features; it drafts what the trained head drafts
    # from scaled features
    loaded = load_eagle_head(out, model, torch.float32, "cpu")
    seqs = [(recs["start"][i], recs["ids"][i].tolist()) for i in hold_idx]
    fresh = accepted_length(loaded, model, seqs, CAPTURE, 3)
    assert abs(fresh - history[-1]["accept_length"]) < 0.1
    assert loaded.draft_vocab_size == draft.numel() and loaded.aux_layers == list(CAPTURE)
    ids = torch.tensor([docs[35][0]])
    with torch.no_grad():
        _, feats = target_pass(model, ids, CAPTURE)
        nxt = torch.zeros_like(ids)
        nxt[:, :-1] = ids[:, 1:]
        head.eval()
        pairs = zip(unroll(head, feats / scale, nxt, 3, False), unroll(loaded, feats, nxt, 3, False))
        for a, b in pairs:
            assert torch.equal(head.to_target_ids(a.argmax(-1)), loaded.to_target_ids(b.argmax(-1)))
