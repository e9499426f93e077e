"""EAGLE / EAGLE-3 draft heads: loading published-layout folders, the serving draft loop
against the whole-sequence reference, greedy outputs identical to plain decoding, and the
flags."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from loom.runtime.model_loader import load_config, load_model
from loom.runtime.server_args import BUNDLED_MODEL_PATH, ServerArgs
from loom.runtime.spec.eagle import (
    build_eagle_head,
    head_config,
    load_eagle_head,
    save_eagle_head,
)
from loom.runtime.spec.eagle_unroll import target_pass, unroll
from tests.runtime_helpers import greedy, make_scheduler, run_all, submit

AUX = [0, 1, 1]  # the tiny targets have 2 layers


def _target(path):
    return load_model(path, torch.float32, "cpu", load_config(path))


def _random_head(target, variant: str, seed: int = 0, scale: float = 0.3, **overrides):
    if variant == "eagle3":
        overrides.setdefault("eagle_config", {"eagle_aux_hidden_state_layer_ids": AUX})
    head = build_eagle_head(
        head_config(target.config, variant, **overrides), target, torch.float32, "cpu"
    )
    g = torch.Generator().manual_seed(seed)
    for p in head.parameters():
        if p.dim() >= 2:
            p.data.copy_(torch.randn(p.shape, generator=g) * scale / p.shape[1] ** 0.5)
        else:
            p.data.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
    return head


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def heads(llama, tmp_path_factory):
    """Random EAGLE and EAGLE-3 (reduced vocabulary) heads for the tiny llama, as folders."""
    target = _target(llama)
    root = tmp_path_factory.mktemp("eagle_heads")
    e = _random_head(target, "eagle")
    save_eagle_head(e, root / "eagle")
    e3 = _random_head(target, "eagle3", draft_vocab_size=150)
    e3.d2t.copy_(torch.arange(0, 300, 2) - torch.arange(150))  # draft id i -> target id 2i
    save_eagle_head(e3, root / "eagle3")
    return {"EAGLE": str(root / "eagle"), "EAGLE3": str(root / "eagle3")}


# --------------------------------------------------------------------------- checkpoints
def test_published_eagle3_layout_loads(llama, tmp_path):
    """A folder written by hand with the published EAGLE-3 names (unfused q/k/v and gate/up,
    midlayer.*, d2t / t2d, its own lm_head) loads, each tensor in its place."""
    target = _target(llama)
    h, inter, heads_, kv, hd, vd = 64, 128, 4, 2, 16, 100
    g = torch.Generator().manual_seed(1)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    tensors = {
        "fc.weight": r(h, 3 * h),
        "midlayer.self_attn.q_proj.weight": r(heads_ * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": r(kv * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": r(kv * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": r(h, heads_ * hd),
        "midlayer.mlp.gate_proj.weight": r(inter, h),
        "midlayer.mlp.up_proj.weight": r(inter, h),
        "midlayer.mlp.down_proj.weight": r(h, inter),
        "midlayer.input_layernorm.weight": r(h),
        "midlayer.hidden_norm.weight": r(h),
        "midlayer.post_attention_layernorm.weight": r(h),
        "norm.weight": r(h),
        "lm_head.weight": r(vd, h),
        "d2t": torch.arange(vd) * 2,  # draft id i -> target id 3i
        "t2d": torch.zeros(384, dtype=torch.bool),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "hidden_size": h,
        "intermediate_size": inter,
        "num_attention_heads": heads_,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 2048,
        "vocab_size": 384,
        "draft_vocab_size": vd,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX},
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    head = load_eagle_head(tmp_path, target, torch.float32, "cpu")
    assert head.variant == "eagle3" and head.aux_layers == AUX and head.draft_vocab_size == vd
    qkv = head.midlayer.self_attn.qkv_proj.weight
    assert torch.equal(qkv[: heads_ * hd], tensors["midlayer.self_attn.q_proj.weight"])
    assert torch.equal(qkv[-kv * hd :], tensors["midlayer.self_attn.v_proj.weight"])
    assert torch.equal(
        head.midlayer.mlp.gate_up_proj.weight[inter:], tensors["midlayer.mlp.up_proj.weight"]
    )
    assert torch.equal(head.midlayer.hidden_norm.weight, tensors["midlayer.hidden_norm.weight"])
    assert head.to_target_ids(torch.tensor([0, 5])).tolist() == [0, 15]
    # written back under the same names
    out = head.checkpoint_tensors()
    for name, t in tensors.items():
        if name != "t2d":
            assert torch.equal(out[name], t), name
    assert out["t2d"].sum() == vd and bool(out["t2d"][15])


def test_eagle_layout_round_trip_and_errors(llama, heads, tmp_path):
    target = _target(llama)
    head = load_eagle_head(heads["EAGLE"], target, torch.float32, "cpu")
    assert head.variant == "eagle" and head.fc.in_features == 2 * 64
    names = set(head.checkpoint_tensors())
    assert {
        "fc.weight",
        "layers.0.self_attn.q_proj.weight",
        "layers.0.mlp.gate_proj.weight",
    } <= names
    assert not any("input_layernorm" in n for n in names)  # EAGLE's first layer has none
    # a missing tensor, another architecture, no folder: ValueErrors that name the problem
    from safetensors.torch import load_file

    t = load_file(f"{heads['EAGLE']}/model.safetensors")
    t.pop("layers.0.mlp.down_proj.weight")
    (tmp_path / "config.json").write_text(open(f"{heads['EAGLE']}/config.json").read())
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing tensors.*down_proj"):
        load_eagle_head(tmp_path, target, torch.float32, "cpu")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="speculative_draft_model_path: .*not an EAGLE head"):
        load_eagle_head(tmp_path, target, torch.float32, "cpu")
    with pytest.raises(ValueError, match="speculative_draft_model_path: .* no config.json"):
        load_eagle_head(tmp_path / "nowhere", target, torch.float32, "cpu")


# --------------------------------------------------------------------------- the draft loop
class _Recorder:
    """Wraps a drafter's draft() to record (sequence so far, draft)."""

    def __init__(self, drafter):
        self.drafter, self.calls = drafter, []
        original = drafter.draft

        def draft(req, room, free_drafts=True):
            d = original(req, room, free_drafts)
            self.calls.append((list(req.origin_input_ids) + list(req.output_ids), list(d)))
            return d

        drafter.draft = draft


@pytest.mark.parametrize("algo", ["EAGLE", "EAGLE3"])
def test_serving_drafts_match_whole_sequence_reference(llama, heads, algo):
    """The paged draft loop (catch-up extend + decode steps through the pool and the target's
    req_to_token rows, page size 4, a radix-cached prefix) drafts exactly what the
    whole-sequence unroll drafts from the same committed prefix."""
    sched = make_scheduler(
        llama, page_size=4, speculative_algorithm=algo, speculative_draft_model_path=heads[algo],
        speculative_num_steps=3,
    )  # fmt: skip
    rec = _Recorder(sched.decode.drafter)
    prompt = list(range(5, 40))
    submit(sched, "warm", prompt, greedy(4))
    run_all(sched)
    submit(sched, "a", prompt + [50, 51, 52], greedy(20))
    out = run_all(sched)["a"]
    seq = torch.tensor([prompt + [50, 51, 52] + out.ids])
    head = sched.decode.drafter.head
    _, feats = target_pass(
        sched.decode.drafter.runner.model, seq, tuple(head.aux_layers or ()) or None
    )
    nxt = torch.zeros_like(seq)
    nxt[:, :-1] = seq[:, 1:]
    outs = unroll(head, feats, nxt, 3, teacher_forcing=False)
    ref = torch.stack([head.to_target_ids(o[0].argmax(-1)) for o in outs])  # [steps, T]
    checked = 0
    for context, draft in rec.calls:
        if not draft or len(context) < len(prompt) + 4:
            continue
        c = len(context) - 2  # the chain starts after the last committed position
        want = [int(ref[s, c + s]) for s in range(len(draft))]
        assert draft == want, (len(context), draft, want)
        checked += 1
    assert checked >= 5, rec.calls


# --------------------------------------------------------------------------- greedy identity
TEXTS = [
    "The quick brown fox",
    "Paris is the capital of",
    '{"name": "Alice", "age"',
    "def add(a, b): return",
    "Thought: I should search.",
]
CONSTRAINTS = [
    {"regex": r"(yes|no), [a-z]{2,6}\."},
    {
        "json_schema": json.dumps(
            {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
        )
    },
]


def _prompts(tok, n_free: int, n_constrained: int):
    out = []
    for i in range(n_free):
        t = TEXTS[i % len(TEXTS)] + " " * (i // len(TEXTS))
        out.append((tok.encode(t), greedy(8 + i % 3 * 2)))
    for i in range(n_constrained):
        c = CONSTRAINTS[i % len(CONSTRAINTS)]
        out.append((tok.encode(f"Answer {i}: "), {**greedy(14), "ignore_eos": False, **c}))
    return out


def _run(path, prompts, **kw):
    sched = make_scheduler(path, disable_jump_forward=True, **kw)
    for i, (ids, params) in enumerate(prompts):
        submit(sched, f"p{i}", ids, params)
    return run_all(sched), sched


@pytest.mark.parametrize("radix_off", [False, True], ids=["radix-on", "radix-off"])
def test_greedy_identical_with_eagle_heads_on_tiny_model(llama, heads, radix_off):
    """20 free + 6 constrained prompts in one batch, x EAGLE / EAGLE3 (random heads: the
    drafts are mostly wrong, so rejection and grammar cuts are exercised at every position);
    with both radix settings, 52 prompts per algorithm."""
    tok = make_scheduler(llama).tokenizer
    prompts = _prompts(tok, 20, 6)
    plain, _ = _run(llama, prompts, disable_radix_cache=radix_off)
    for algo in ("EAGLE", "EAGLE3"):
        spec, sched = _run(
            llama, prompts, disable_radix_cache=radix_off, speculative_algorithm=algo,
            speculative_draft_model_path=heads[algo], speculative_disable_by_batch_size=64,
        )  # fmt: skip
        for i in range(len(prompts)):
            assert spec[f"p{i}"].ids == plain[f"p{i}"].ids, (algo, i)
            assert spec[f"p{i}"].finish_reason == plain[f"p{i}"].finish_reason
        assert sched.get_state()["spec_verify_ct"] > 0


def test_sampled_constrained_outputs_follow_their_grammar(llama, heads):
    """Temperature 1 through rejection sampling with EAGLE-3 drafts: every output matches
    its regex (drafts are cut by the grammar, every verified position is masked)."""
    import re

    tok = make_scheduler(llama).tokenizer
    prompts = [
        (tok.encode(f"Answer {i}: "), {"temperature": 1.0, "max_new_tokens": 24, **CONSTRAINTS[0]})
        for i in range(6)
    ]
    out, sched = _run(
        llama, prompts, speculative_algorithm="EAGLE3", speculative_draft_model_path=heads["EAGLE3"]
    )
    stopped = [
        out[f"p{i}"] for i in range(len(prompts)) if out[f"p{i}"].finish_reason["type"] == "stop"
    ]
    assert len(stopped) >= 3
    for r in stopped:
        assert re.fullmatch(CONSTRAINTS[0]["regex"], r.text), r.text
    assert sched.get_state()["spec_verify_ct"] > 0


# --------------------------------------------------------------------------- flags
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"speculative_algorithm": "EAGLE", "speculative_eagle_topk": 4},
            "^speculative_eagle_topk: .*not supported yet",
        ),
        ({"speculative_algorithm": "MEDUSA"}, "^speculative_algorithm: .*not supported yet"),
        (
            {"speculative_draft_model_path": "/x"},
            "^speculative_draft_model_path: needs --speculative-algorithm",
        ),
        (
            {"speculative_algorithm": "NGRAM", "speculative_num_steps": 3},
            "^speculative_num_steps: needs",
        ),
        (
            {"speculative_algorithm": "EAGLE", "speculative_num_steps": 0},
            "^speculative_num_steps: must be",
        ),
        (
            {
                "speculative_algorithm": "EAGLE",
                "speculative_num_steps": 3,
                "speculative_num_draft_tokens": 8,
            },
            "^speculative_num_draft_tokens: must be speculative_num_steps \\+ 1",
        ),
    ],
)
def test_eagle_flags_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ServerArgs(**kwargs)


def test_eagle_flags_defaults_and_head_path_errors(llama):
    assert ServerArgs(speculative_algorithm="EAGLE").effective_speculative_num_steps == 4
    args = ServerArgs(speculative_algorithm="EAGLE", speculative_num_draft_tokens=6)
    assert args.effective_speculative_num_steps == 5
    with pytest.raises(ValueError, match="^speculative_draft_model_path: needed"):
        make_scheduler(llama, speculative_algorithm="EAGLE")


def test_wrong_head_kind_for_the_algorithm_is_refused(llama, heads):
    with pytest.raises(ValueError, match="^speculative_draft_model_path: .* EAGLE3 head"):
        make_scheduler(
            llama, speculative_algorithm="EAGLE", speculative_draft_model_path=heads["EAGLE3"]
        )


@pytest.mark.parametrize("algo", ["EAGLE", "EAGLE3"])
def test_bundled_model_uses_its_shipped_head(algo):
    """With no path, the bundled model drafts with its shipped head, and a trained head
    drafts well: a chat answer mostly arrives in verified chains."""
    sched = make_scheduler(BUNDLED_MODEL_PATH, speculative_algorithm=algo)
    assert sched.decode.drafter.head.variant == algo.lower()
    tok = sched.tokenizer
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    submit(sched, "a", tok.encode(chat), greedy(24))
    run_all(sched)
    assert sched.get_state()["spec_accept_length"] >= 2.0, sched.get_state()
