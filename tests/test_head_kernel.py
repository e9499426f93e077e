"""The compiled draft heads (runtime/spec/head_kernel.py) against the eager heads they replace:
EAGLE / EAGLE-3's catch-up and chain loop (hidden states and every level's logits allclose,
the same draft tokens, the same K/V in the head's pool) and Medusa's heads (log-probabilities
allclose, the same top-k), plus the drafters picking them up on the default CPU path."""

from __future__ import annotations

import pytest
import torch

from loom.runtime.attention.torch_backend import TorchAttnBackend
from loom.runtime.forward_batch import ForwardBatch, ForwardMode, forward_context
from loom.runtime.memory_pool import ReqToTokenPool, TokenToKVPool
from loom.runtime.model_loader import load_config, load_model
from loom.runtime.models.llama import head_dim_of
from loom.runtime.spec.eagle import build_eagle_head, head_config
from loom.runtime.spec.eagle_tree import TreeAttention, grow_trees
from loom.runtime.spec.head_kernel import CompiledEagleHead, CompiledMedusaHeads
from loom.runtime.spec.medusa import build_medusa_heads
from tests.runtime_helpers import greedy, make_scheduler, run_all, submit


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    path = tiny_model_dir("llama")
    return load_model(path, torch.float32, "cpu", load_config(path))


def _random_head(target, variant: str, **overrides):
    if variant == "eagle3":
        overrides.setdefault("eagle_config", {"eagle_aux_hidden_state_layer_ids": [0, 1, 1]})
    head = build_eagle_head(
        head_config(target.config, variant, **overrides), target, torch.float32, "cpu"
    )
    g = torch.Generator().manual_seed(3)
    for p in head.parameters():
        if p.dim() >= 2:
            p.data.copy_(torch.randn(p.shape, generator=g) * 0.5 / p.shape[1] ** 0.5)
        else:
            p.data.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
    if hasattr(head, "d2t"):  # a reduced draft vocabulary
        n = head.draft_vocab_size
        head.d2t.copy_(torch.arange(0, 2 * n, 2) - torch.arange(n))  # draft id i -> target 2i
    return head


# two requests in table rows 2 and 0: committed prefixes of 6 and 9 entries, then 3 and 1 new
# rows in this step's catch-up; both draft
PREFIX, NEW, ROWS = [6, 9], [3, 1], [2, 0]


def _round_bf16_inputs(head) -> list:
    """Forward pre-hooks rounding the input of every head matmul whose weights are all
    bfloat16 values to bfloat16: the products the compiled head takes with
    `bf16_inputs` (exact in float32 either way; only the summation order differs)."""
    hooks = []
    for mod in head.modules():
        w = getattr(mod, "weight", None)
        if (
            isinstance(w, torch.Tensor)
            and w.dim() == 2
            and w.shape[1] % 2 == 0
            and not isinstance(mod, torch.nn.Embedding)
            and torch.equal(w.to(torch.bfloat16).float(), w)
        ):
            hooks.append(
                mod.register_forward_pre_hook(
                    lambda m, args: (args[0].to(torch.bfloat16).float(), *args[1:])
                )
            )
    return hooks


@pytest.mark.parametrize(
    "variant, overrides, bf16, inputs16",
    [
        ("eagle", {}, False, False),
        ("eagle", {"num_hidden_layers": 2, "fc_bias": True}, False, False),
        ("eagle", {"draft_vocab_size": 150}, False, False),
        ("eagle3", {"draft_vocab_size": 150}, False, False),
        ("eagle3", {"draft_vocab_size": 150}, True, False),
        ("eagle", {"num_hidden_layers": 2, "fc_bias": True}, True, False),
        ("eagle3", {"draft_vocab_size": 150}, True, True),
        ("eagle", {"num_hidden_layers": 2, "fc_bias": True}, True, True),
    ],
    ids=[
        "eagle", "eagle-2-layers-fc-bias", "eagle-reduced-vocab", "eagle3-reduced-vocab",
        "eagle3-bf16-weights", "eagle-2-layers-bf16-weights",
        "eagle3-bf16-weights-and-inputs", "eagle-2-layers-bf16-weights-and-inputs",
    ],
)  # fmt: skip
def test_compiled_round_matches_the_eager_head(target, variant, overrides, bf16, inputs16):
    """bf16: every head weight a bfloat16 value (a bf16 checkpoint's), so an AVX-512 build
    reads the head's matmuls from bfloat16 panels (EAGLE-1's LM head, the target's float32
    rows, stays float32). inputs16: those matmuls also round their inputs to bfloat16 (the
    default where the build has VDPBF16PS), against an eager head whose same matmuls do."""
    head = _random_head(target, variant, **overrides)
    if bf16:
        with torch.no_grad():
            for p in head.parameters():
                p.copy_(p.to(torch.bfloat16).float())
    cfg = head.config
    n_layers = cfg.num_hidden_layers if variant == "eagle" else 1
    kv = TokenToKVPool(
        64, n_layers, cfg.num_key_value_heads, head_dim_of(cfg), torch.float32, "cpu"
    )
    g = torch.Generator().manual_seed(5)
    for buf in kv.k_buffers + kv.v_buffers:
        buf.copy_(torch.randn(buf.shape, generator=g))  # the committed entries' K/V
    table = ReqToTokenPool(3, 32, "cpu")
    perm = torch.randperm(60, generator=g) + 1  # scattered slots, as the allocator leaves them
    seq = [p + n for p, n in zip(PREFIX, NEW)]
    at = 0
    for row, s in zip(ROWS, seq):
        table.req_to_token[row, :s] = perm[at : at + s]
        at += s
    vocab = target.config.vocab_size
    ids = torch.randint(0, vocab, (sum(NEW),), generator=g)
    pos = torch.tensor([p + j for p, n in zip(PREFIX, NEW) for j in range(n)])
    slots = torch.cat([table.req_to_token[r, p:s] for r, p, s in zip(ROWS, PREFIX, seq)])
    feats = torch.randn(sum(NEW), head.feature_size, generator=g)
    steps = 4
    snapshot = [b.clone() for b in kv.k_buffers + kv.v_buffers]

    compiled = CompiledEagleHead.build(head, kv, topk=1, bf16_inputs=inputs16)
    assert compiled is not None
    assert compiled.bf16 == (bf16 and compiled.lib.loom_isa_bits() == 512)
    assert compiled.bf16_inputs == (
        compiled.bf16 and inputs16 and compiled.lib.loom_head_bf16_dot() == 1
    )
    if inputs16 and not compiled.bf16_inputs:
        pytest.skip("this build has no VDPBF16PS (AVX512_BF16)")
    if compiled.bf16_inputs:
        _round_bf16_inputs(head)
    starts = [0, NEW[0], sum(NEW)]
    tokens, logits, hidden = compiled.run(
        ids, pos, slots, feats, starts, ROWS, seq, table.req_to_token, [0, 1], steps,
        want_logits=True, want_hidden=True,
    )  # fmt: skip
    written = [b[slots].clone() for b in kv.k_buffers + kv.v_buffers]
    for b, s in zip(kv.k_buffers + kv.v_buffers, snapshot):
        b.copy_(s)

    # the eager reference: the drafter's catch-up extend, then grow_trees' chain loop
    batch = ForwardBatch(
        mode=ForwardMode.EXTEND, input_ids=ids, positions=pos, out_cache_loc=slots,
        req_pool_indices=torch.tensor(ROWS), seq_lens=torch.tensor(seq), seq_lens_cpu=seq,
        prefix_lens_cpu=PREFIX, req_to_token_pool=table, token_to_kv_pool=kv,
        attn_backend=TorchAttnBackend(), logits_indices=torch.tensor([NEW[0] - 1, sum(NEW) - 1]),
    )  # fmt: skip
    batch.attn_backend.init_forward_metadata(batch)
    with forward_context(batch):
        ref_hidden = head(pos, ids, feats, True)
    torch.testing.assert_close(hidden, ref_hidden, atol=2e-4, rtol=2e-4)
    for got, b in zip(written, kv.k_buffers + kv.v_buffers):
        torch.testing.assert_close(got, b[slots], atol=2e-4, rtol=2e-4)
    levels = []
    eager_logits = head.logits
    head.logits = lambda h: levels.append(eager_logits(h)) or levels[-1]
    seq_t = torch.tensor(seq)
    committed = torch.arange(max(seq))[None, :] < seq_t[:, None]
    cols = table.req_to_token[ROWS, : max(seq)].masked_fill(~committed, 0)
    attn = TreeAttention(kv, cols, committed, 1, steps)
    last = ref_hidden[torch.tensor([NEW[0] - 1, sum(NEW) - 1])]
    trees = grow_trees(head, last, seq_t, attn, steps, 1, steps)
    del head.logits
    assert len(levels) == steps
    for level in range(steps):
        torch.testing.assert_close(logits[level], levels[level], atol=5e-4, rtol=5e-4)
    assert tokens.tolist() == [t for t, _ in trees]
    assert all(p == [-1, 0, 1, 2] for _, p in trees)
    assert compiled.profile.min() > 0  # the round's own catch-up / loop split was kept

    # without hidden_out the catch-up's last layer runs past its K/V only for the drafting
    # requests' last rows: the same K/V, drafts and logits, for both requests or one
    for draft_reqs in ([0, 1], [1]):
        for b, s in zip(kv.k_buffers + kv.v_buffers, snapshot):
            b.copy_(s)
        got, got_logits, _ = compiled.run(
            ids, pos, slots, feats, starts, ROWS, seq, table.req_to_token, draft_reqs, steps,
            want_logits=True,
        )  # fmt: skip
        for w, b in zip(written, kv.k_buffers + kv.v_buffers):
            torch.testing.assert_close(b[slots], w, atol=0, rtol=0)
        assert got.tolist() == tokens[draft_reqs].tolist()
        torch.testing.assert_close(got_logits, logits[:, draft_reqs], atol=2e-5, rtol=2e-5)


def test_compiled_eagle_head_covers_chains_only(target):
    head = _random_head(target, "eagle")
    kv = TokenToKVPool(8, 1, head.config.num_key_value_heads, 64, torch.float32, "cpu")
    assert CompiledEagleHead.build(head, kv, topk=2) is None  # trees run eager
    bf16 = TokenToKVPool(8, 1, head.config.num_key_value_heads, 64, torch.bfloat16, "cpu")
    assert CompiledEagleHead.build(head, bf16, topk=1) is None


@pytest.mark.parametrize("reduced", [False, True], ids=["full-vocab", "draft-vocab"])
@pytest.mark.parametrize("own", [False, True], ids=["shared-lm-head", "own-lm-heads"])
def test_compiled_medusa_heads_match_the_eager_heads(target, own, reduced):
    heads = build_medusa_heads(3, 2, target, own, torch.float32, "cpu")
    g = torch.Generator().manual_seed(0)
    for p in heads.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.5 / p.shape[-1] ** 0.5)
    if reduced:  # a sorted subset of the target's ids
        heads.draft_ids = torch.randperm(heads.vocab_size, generator=g)[:60].sort().values
    compiled = CompiledMedusaHeads.build(heads)
    assert compiled is not None
    h = torch.randn(5, target.config.hidden_size, generator=g)
    logp, ids = compiled.run(h, 4)  # [n, k, 4], target ids
    ref_logp, ref_ids = heads.draft_logits(h).log_softmax(-1).topk(4, dim=-1)  # [k, n, 4]
    if reduced:
        ref_ids = heads.draft_ids[ref_ids]
        assert set(ids.flatten().tolist()) <= set(heads.draft_ids.tolist())
    assert ids.tolist() == ref_ids.transpose(0, 1).tolist()
    torch.testing.assert_close(logp, ref_logp.transpose(0, 1), atol=1e-4, rtol=1e-4)


def test_draft_vocabularies_round_trip_and_are_checked(target, tmp_path):
    """EAGLE-1 and Medusa folders carry a reduced draft vocabulary as config
    draft_vocab_size + a d2t tensor; one without the other is refused by name."""
    import json

    from safetensors.torch import load_file, save_file

    from loom.runtime.spec.eagle import load_eagle_head, save_eagle_head
    from loom.runtime.spec.medusa import load_medusa_heads, save_medusa_heads

    head = _random_head(target, "eagle", draft_vocab_size=150)
    save_eagle_head(head, tmp_path / "e")
    back = load_eagle_head(tmp_path / "e", target, torch.float32, "cpu")
    assert back.reduced and torch.equal(back.d2t, head.d2t)
    assert back.to_target_ids(torch.tensor([0, 3])).tolist() == [0, 6]
    tensors = load_file(tmp_path / "e" / "model.safetensors")
    del tensors["d2t"]
    save_file(tensors, tmp_path / "e" / "model.safetensors")
    with pytest.raises(ValueError, match="d2t"):
        load_eagle_head(tmp_path / "e", target, torch.float32, "cpu")

    heads = build_medusa_heads(2, 1, target, False, torch.float32, "cpu")
    heads.draft_ids = torch.arange(0, 200, 2)
    save_medusa_heads(heads, tmp_path / "m")
    back = load_medusa_heads(tmp_path / "m", target, torch.float32, "cpu")
    assert torch.equal(back.draft_ids, heads.draft_ids)
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    del cfg["draft_vocab_size"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="draft_vocab_size"):
        load_medusa_heads(tmp_path / "m", target, torch.float32, "cpu")


@pytest.mark.parametrize("algo", ["EAGLE3", "MEDUSA"])
def test_drafters_use_the_compiled_heads_unless_the_forward_is_eager(
    tiny_model_dir, target, tmp_path, algo
):
    """On the default CPU path the drafter runs its compiled head and still drafts (verified
    chains / trees); --cpu-forward eager keeps the eager head; greedy outputs agree."""
    from loom.runtime.spec.eagle import save_eagle_head
    from loom.runtime.spec.medusa import save_medusa_heads
    from tests.test_medusa import _random_heads

    if algo == "MEDUSA":
        save_medusa_heads(_random_heads(target), tmp_path)
    else:
        save_eagle_head(_random_head(target, "eagle3", draft_vocab_size=150), tmp_path)
    outs = {}
    for mode in ("auto", "eager"):
        sched = make_scheduler(
            tiny_model_dir("llama"), cpu_forward=mode, speculative_algorithm=algo,
            speculative_draft_model_path=str(tmp_path),
        )  # fmt: skip
        assert (sched.decode.drafter.compiled is not None) == (mode == "auto")
        submit(sched, "a", list(range(5, 30)), greedy(12))
        outs[mode] = run_all(sched)["a"].ids
        assert sched.get_state()["spec_verify_ct"] > 0
    assert outs["auto"] == outs["eager"]
