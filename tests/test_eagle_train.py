"""python -m loom.train_eagle end to end on a tiny target: the head folder it writes loads for
serving, training lowers the held-out loss, a rerun resumes from the checkpoint, bad flags
are refused by name."""

from __future__ import annotations

import json
import random

import pytest
import torch

from loom.runtime.model_loader import load_model
from loom.runtime.spec.eagle import load_eagle_head
from loom.train_eagle import main, parse_args

WORDS = "the quick brown fox jumps over the lazy dog Paris is the capital of France".split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = random.Random(0)
    root = tmp_path_factory.mktemp("eagle_corpus")
    docs = []
    for _ in range(60):  # repetitive text: the target's next tokens are easy to predict
        start = rng.randrange(len(WORDS))
        docs.append(" ".join(WORDS[(start + i) % len(WORDS)] for i in range(24)))
    (root / "a.txt").write_text("\n\n".join(docs[:40]))
    with open(root / "b.jsonl", "w") as f:
        for d in docs[40:]:
            f.write(json.dumps({"text": d}) + "\n")
    return root


def _args(target, corpus, out, *extra):
    return [
        "--target", target, "--data", str(corpus), "--out", str(out), "--seq-len", "32",
        "--batch-size", "4", "--epochs", "2", "--unroll", "2", "--eval-steps", "3",
        "--eval-prompts", "2", "--eval-tokens", "8", "--holdout", "0.1", "--no-progress",
        "--lr", "1e-2", "--threads", "1", *extra,
    ]  # fmt: skip


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """--threads sets torch's process-wide thread count (one thread: tiny matmuls on a loaded
    2-core machine run ~8x faster than with oversubscribed threads); later tests get theirs back."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("variant", ["eagle", "eagle3"])
def test_train_writes_a_loadable_head_and_resumes(
    tiny_model_dir, corpus, tmp_path, variant, capsys
):
    target = tiny_model_dir("llama")
    extra = (
        ["--eagle3", "--aux-layers", "0,1,1", "--draft-vocab-size", "64"]
        if variant == "eagle3"
        else []
    )
    out = tmp_path / "head"
    assert main(_args(target, corpus, out, *extra)) == 0
    printed = capsys.readouterr().out
    assert "untrained head: held-out mean accepted length" in printed
    assert "epoch 2:" in printed and "-> trained" in printed
    for name in ("config.json", "model.safetensors", "checkpoint.pt", "history.json", "loss.png"):
        assert (out / name).is_file(), name
    history = json.loads((out / "history.json").read_text())
    epochs = history["epochs"]
    assert len(epochs) == 2 and all(e["accept_length"] >= 1.0 for e in epochs)
    losses = [loss for _, loss, _ in history["step_loss"]]
    assert losses[-1] < losses[0]  # it learns something
    model = load_model(target, torch.float32, "cpu")
    head = load_eagle_head(out, model, torch.float32, "cpu")
    assert head.variant == variant
    if variant == "eagle3":
        assert head.draft_vocab_size == 64 and head.aux_layers == [0, 1, 1]
    if variant == "eagle3":
        return
    # a rerun finds the finished checkpoint: nothing left to train, same head
    assert main(_args(target, corpus, out, *extra)) == 0
    assert "resumed from" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--medusa", "--eagle3"], "--medusa: trains Medusa heads"),
        (["--draft-vocab-size", "64"], "--draft-vocab-size: only EAGLE-3"),
        (["--epochs", "0"], "--epochs: must be >= 1"),
    ],
)
def test_bad_flags_are_refused_by_name(argv, match, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--target", "t", "--data", "d", "--out", "o", *argv])
    assert match in capsys.readouterr().err


def test_heldout_greedy_continuations_with_a_kv_cache_equal_whole_sequence_passes(llama):
    """`greedy_generate` (the held-out continuations the accepted length is measured on)
    extends one row at a time over a KV cache: its tokens equal a whole-sequence pass per
    token (the uncached way) on the tiny llama, to the length cap and through an eos."""
    from loom.runtime.model_loader import load_config
    from loom.runtime.spec.eagle_unroll import target_pass
    from loom.runtime.spec.head_training import greedy_generate

    model = load_model(llama, torch.float32, "cpu", load_config(llama))

    def uncached(prompt, n, eos):
        seq = list(prompt)
        for _ in range(n):
            logits, _ = target_pass(model, torch.tensor([seq]), None)
            seq.append(int(logits[0, -1].argmax()))
            if seq[-1] in eos:
                break
        return seq

    with torch.no_grad():
        for prompt in ([5, 6, 7, 8, 9, 10], [100, 3, 42, 7]):
            want = uncached(prompt, 16, set())
            assert greedy_generate(model, prompt, 16, set()) == want
            eos = {want[len(prompt) + 5]}  # the 6th new token (or an earlier equal one) ends it
            assert greedy_generate(model, prompt, 16, eos) == uncached(prompt, 16, eos)
