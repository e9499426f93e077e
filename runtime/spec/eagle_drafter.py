"""EAGLE / EAGLE-3 drafting beside the target: the head's KV, its catch-up and its draft loop.

The scheduler calls the drafter after each target forward (`after_forward`, the target's
features in `ForwardOutput.hidden`), so all head work happens right after each target step,
on the target's device, batched over the step's requests:

1. catch-up: one head extend over the positions the step committed. Entry p reads [emb(token
   p+1); target feature p]: the fed tokens shifted by one, then the step's accepted drafts
   and its sampled token (a prompt chunk that sampled nothing stops one short: its next
   token comes with the next chunk). The head's KV lives in its own pool of the target's
   design (`TokenToKVPool`, same slot count) at the SAME slots as the target's KV for those
   positions, so it is found through the target's `req_to_token` rows, survives in the
   radix cache with them and is freed with them.
2. draft loop: `num_steps - 1` decode steps of the head from its own output hidden state,
   greedy, attending to the committed entries (gathered once per loop) plus the loop's own
   entries (kept in a small list, never written to the pool). No scheduler work per draft
   step; one device -> host copy per loop.

The drafts wait in a per-request-row slot until the scheduler asks (`draft`), tagged with the
request length they were made for; a mismatch (retraction, a new request in the row) yields
no draft. Drafts of constrained requests are cut at the first token the grammar refuses.
Verification is the target's, so any draft (stale, garbage) changes speed, never output.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import torch

from loom.runtime.forward_batch import ForwardBatch, ForwardMode, forward_context, host_tensor
from loom.runtime.spec import DraftTree, HeadDrafter, tree_depths
from loom.runtime.spec.eagle_tree import TreeAttention, graft_forced, grow_trees
from loom.runtime.spec.head_policy import (
    HeadGate,
    NgramPolicy,
    matmul_numel,
    target_matmul_numel,
)
from loom.runtime.spec.stats import AcceptanceStats

logger = logging.getLogger(__name__)

BUNDLED_HEADS = Path(__file__).resolve().parent.parent / "bundled" / "eagle"


def bundled_head_path(args) -> str:
    """The head shipped for the bundled model (EAGLE: bundled/eagle, EAGLE3: bundled/eagle/eagle3)."""
    from loom.runtime.server_args import BUNDLED_MODEL_PATH

    algo = args.speculative_algorithm.upper()
    folder = BUNDLED_HEADS / "eagle3" if algo == "EAGLE3" else BUNDLED_HEADS
    same = Path(args.model_path).resolve() == Path(BUNDLED_MODEL_PATH).resolve()
    if not same or not (folder / "config.json").is_file():
        raise ValueError(
            f"speculative_draft_model_path: needed for --speculative-algorithm {algo} (a head "
            "ships only for the bundled model; train one with python -m loom.train_eagle)"
        )
    return str(folder)


class EagleSpeculator(HeadDrafter):
    def __init__(self, args, runner, tokenizer, vocab_size: int, eos_token_ids, grammar=None):
        from loom.runtime.attention.base import create_attention_backend
        from loom.runtime.memory_pool import TokenToKVPool
        from loom.runtime.models.llama import head_dim_of
        from loom.runtime.spec.eagle import load_eagle_head

        algo = args.speculative_algorithm.upper()
        if runner is None:
            raise ValueError(f"speculative_algorithm: {algo} needs the model runner")
        path = args.speculative_draft_model_path or bundled_head_path(args)
        head = load_eagle_head(path, runner.model, runner.dtype, runner.device)
        want = "eagle3" if algo == "EAGLE3" else "eagle"
        if head.variant != want:
            raise ValueError(
                f"speculative_draft_model_path: {path} holds an {head.variant.upper()} head, "
                f"--speculative-algorithm {algo} needs an {want.upper()} one"
            )
        self.head, self.runner = head, runner
        self.steps = args.effective_speculative_num_steps
        self.topk = args.effective_speculative_eagle_topk
        self.num_nodes = args.effective_speculative_num_draft_tokens - 1  # the root aside
        self.disable_batch_size = args.speculative_disable_by_batch_size
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos = frozenset(eos_token_ids)
        cfg = head.config
        n_layers = cfg.num_hidden_layers if head.variant == "eagle" else 1
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        target_kv = runner.token_to_kv_pool
        self.kv = TokenToKVPool(
            target_kv.num_slots,
            n_layers,
            kv_heads,
            head_dim_of(cfg),
            runner.dtype,
            runner.device,
            padding_slots=target_kv.num_slots,
        )  # fmt: skip  (all zero: an entry never written reads as a finite, if useless, value)
        # the catch-up's attention: the target's backend kind (on the CPU, cpu_paged: a few
        # new entries per request read the head's pool in place through the C extend kernel)
        self.extend_backend = create_attention_backend(args.effective_attention_backend)
        self.capture = tuple(head.aux_layers or ())  # () = the final hidden state only
        self.step_capture = self.capture
        rows = runner.req_to_token_pool.size
        # per request row: (the request length the draft is for, (tokens, parents))
        self.pending: list[tuple[int, tuple[list[int], list[int]]] | None] = [None] * rows
        # constrained requests: the head's draft or the n-gram speculator's, by expected gain
        self.policy = NgramPolicy(
            args, tokenizer, vocab_size, eos_token_ids, self.steps, grammar=grammar
        )
        self.grammar = self.policy.grammar
        # positions = tree depths (a graft: clamped), or an n-gram chain's
        self.stats = AcceptanceStats(max(self.steps, self.policy.num_draft))
        # the off-switch / chain cut by measured costs; a draft level of the head reads its
        # layers and its (draft-vocabulary) LM head
        layers = matmul_numel(head.layers if head.variant == "eagle" else [head.midlayer])
        lm = head.draft_vocab_size * cfg.hidden_size
        self.gate = HeadGate(self.steps, (layers + lm) / target_matmul_numel(runner.model))
        # the whole round (catch-up + chain loop) as one C call where it covers the head
        # (runtime/spec/head_kernel.py); with --cpu-forward eager, or for trees, the eager head
        self.compiled = None
        if runner.cpu_forward is not None:
            from loom.runtime.spec.head_kernel import CompiledEagleHead

            self.compiled = CompiledEagleHead.build(head, self.kv, self.topk)
        logger.info(
            "%s head from %s: %d draft steps, top-%d, %d draft tokens",
            algo, path, self.steps, self.topk, self.num_nodes,
        )  # fmt: skip

    # ------------------------------------------------------------ scheduler side
    def enabled_for(self, batch_size: int) -> bool:
        """Also decides whether this decode step captures the target's features: a batch too
        large to draft captures none, so it runs the compiled CPU forward (which covers no
        capture) like plain decoding; the next step captures again."""
        on = batch_size < self.disable_batch_size and self.gate.enabled(batch_size, self.steps)
        self.policy.enabled_for(batch_size)
        self._head_capture(on)
        return on

    def draft(self, req, room: int, free_drafts: bool = True) -> list[int] | DraftTree:
        row = req.req_pool_idx
        pending = self.pending[row] if row is not None else None
        if row is not None:
            self.pending[row] = None
        req.draft_forced = 0
        req.draft_source = None
        if not free_drafts:
            self.stats.skipped += 1
            return []
        use_head = self._uses_head(req)
        fresh = pending is not None and pending[0] == req.seq_len
        tokens, parents = pending[1] if fresh else ([], [])
        budget = max(0, min(room, self.num_nodes))
        if req.grammar is None:
            tokens, parents = tokens[:budget], parents[:budget]  # parents come first
            req.draft_source = "free"
            if self.topk == 1:  # a chain (the chain verify path), cut by the gate's `levels`
                req.draft_expected = sum(self.gate.gains(len(tokens)))
                return tokens
            depth = 1 + max(tree_depths(parents), default=-1)
            req.draft_expected = sum(self.gate.gains(depth))
            return DraftTree(tokens, parents) if tokens else []
        # constrained: the n-gram speculator's draft (walked by the grammar) or the head's
        ngram, ngram_expected = self.policy.ngram_draft(req, room)
        ngram_forced = req.draft_forced
        if not use_head:  # the head skips this constrained request (`NgramPolicy`)
            return self._take_ngram(req, ngram, ngram_expected, ngram_forced)
        forced = self.grammar.forced(req, min(budget, self.steps))
        if forced:  # forced text leads; the head's subtree follows where it agrees with it
            tokens, parents = graft_forced(tokens, parents, forced)
        tokens, parents = tokens[:budget], parents[:budget]
        head_expected = self.policy.head_expected(len(forced), tokens, parents)
        if ngram and ngram_expected >= head_expected:
            return self._take_ngram(req, ngram, ngram_expected, ngram_forced)
        self.policy.chosen["head"] += 1
        req.draft_source, req.draft_expected = "head", head_expected
        if self.topk == 1:  # a chain: the chain verify path
            if tokens:
                tokens = self.grammar.walk(req, tokens)
            req.draft_forced = min(len(forced), len(tokens))
            return tokens
        if tokens:  # pruned before verification
            tokens, parents = self.grammar.walk_tree(req, tokens, parents)
        req.draft_forced = min(len(forced), len(tokens))
        return DraftTree(tokens, parents) if tokens else []

    def _take_ngram(self, req, ngram: list[int], expected: float, forced: int):
        self.policy.take_ngram(req, ngram, expected, forced)
        if self.topk == 1 or not ngram:
            return ngram
        return DraftTree(ngram, list(range(-1, len(ngram) - 1)))

    # ------------------------------------------------------------ runner side
    @torch.inference_mode()
    def after_forward(self, inp, out) -> None:
        import time

        captured = out.hidden
        self._capture(self.capture)  # a step enabled_for turned off is over
        if len(inp.seq_lens) >= self.disable_batch_size or captured is None:
            return  # no drafting at this size; the head's KV for these positions goes stale
        t0 = time.perf_counter()
        final, aux = captured
        feats = final if self.head.variant == "eagle" else torch.cat(aux, dim=-1)
        plan = _catch_up_plan(inp, out, self.policy.headless)
        if plan is None:
            return
        # a chain drafts as many levels as pay at this batch size; a tree its full shape
        levels = self.gate.levels(self.steps) if self.topk == 1 else self.steps
        self._run(plan, feats, inp, levels)
        rows = [s - p for s, p in zip(inp.seq_lens, inp.prefix_lens)]
        if rows == list(inp.sample_counts):  # a decode / verify step: it prices the head
            self.gate.observe(time.perf_counter() - t0, levels, self.runner.last_model_seconds,
                              len(rows), max(rows) - 1)  # fmt: skip
        self._spent(inp, t0)

    def summary(self) -> dict:
        out = super().summary()
        if self.compiled is not None:  # the C round's own wall split: catch-up / draft loop
            catch_up, loop = self.compiled.profile.tolist()
            out["spec_draft_split_seconds"] = [round(catch_up, 4), round(loop, 4)]
        return out

    def _run_compiled(self, plan, feats: torch.Tensor, inp, levels: int) -> None:
        starts = [0] + [r + 1 for r in plan.last_rows]
        drafting = plan.drafting if levels else []
        tokens, _, _ = self.compiled.run(
            host_tensor(plan.next_ids, torch.int64),
            _rows(torch.as_tensor(inp.positions), plan.rows),
            _rows(torch.as_tensor(inp.out_cache_loc), plan.slot_rows),
            _rows(feats, plan.rows).float(),
            starts, plan.req_rows, plan.seq_lens, self.runner.req_to_token_pool.req_to_token,
            drafting, max(1, levels),
        )  # fmt: skip
        for i, chain in zip(drafting, tokens.tolist()):
            chain = chain[: self.num_nodes]
            self.pending[plan.req_rows[i]] = (
                plan.seq_lens[i] + 1,
                (chain, list(range(-1, len(chain) - 1))),
            )

    def _run(self, plan, feats: torch.Tensor, inp, levels: int) -> None:
        """`inp`: the target step's ModelInput (host tensors; moved to the head's device)."""
        if self.compiled is not None:
            return self._run_compiled(plan, feats, inp, levels)
        dev = feats.device
        head = self.head
        rows_t = torch.tensor(plan.rows, dtype=torch.int64)
        positions = torch.as_tensor(inp.positions).to(dev).index_select(0, rows_t.to(dev))
        hb = ForwardBatch(
            mode=ForwardMode.EXTEND,
            input_ids=torch.tensor(plan.next_ids, dtype=torch.int64).to(dev),
            positions=positions,
            out_cache_loc=torch.as_tensor(inp.out_cache_loc)
            .to(dev)
            .index_select(0, torch.tensor(plan.slot_rows, dtype=torch.int64, device=dev)),
            req_pool_indices=torch.tensor(plan.req_rows, dtype=torch.int64).to(dev),
            seq_lens=torch.tensor(plan.seq_lens, dtype=torch.int64).to(dev),
            seq_lens_cpu=plan.seq_lens,
            prefix_lens_cpu=plan.prefix_lens,
            req_to_token_pool=self.runner.req_to_token_pool,
            token_to_kv_pool=self.kv,
            attn_backend=self.extend_backend,
            logits_indices=torch.tensor(plan.last_rows, dtype=torch.int64).to(dev),
        )
        self.extend_backend.init_forward_metadata(hb)
        with forward_context(hb):
            hidden = head(positions, hb.input_ids, feats.index_select(0, rows_t.to(dev)), True)
        if not plan.drafting or not levels:
            return
        pick = torch.tensor([plan.last_rows[i] for i in plan.drafting], device=dev)
        hidden = hidden.index_select(0, pick)
        seq = torch.tensor([plan.seq_lens[i] for i in plan.drafting], device=dev)
        attn = None
        if levels > 1:
            req_rows = torch.tensor([plan.req_rows[i] for i in plan.drafting], device=dev)
            width = int(seq.max())
            table = self.runner.req_to_token_pool.req_to_token
            committed = torch.arange(width, device=dev)[None, :] < seq[:, None]
            slots = table[req_rows, :width].masked_fill(~committed, 0)
            attn = TreeAttention(self.kv, slots, committed, self.topk, levels)
        trees = grow_trees(head, hidden, seq, attn, levels, self.topk, self.num_nodes)
        # the request then holds its committed positions + the sampled token
        for i, tree in zip(plan.drafting, trees):
            self.pending[plan.req_rows[i]] = (plan.seq_lens[i] + 1, tree)


class _Plan(SimpleNamespace):
    pass


def _rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t's rows `rows` (increasing): a view when they are 0 .. n-1 (a chain verify or a
    prefill whose every fed row is kept), else a gathered copy."""
    if rows[-1] == len(rows) - 1:
        return t[: len(rows)]
    return t.index_select(0, torch.tensor(rows, dtype=torch.int64, device=t.device))


def _catch_up_plan(inp, out, headless=()):
    """Which fed rows the head's catch-up covers, per request: the rows whose next token is
    known (fed tokens shifted by one, then the accepted drafts and the sampled token). After a
    tree verify those rows are the last real token's and the accepted path's (`rows`), while
    the head's KV goes to the slots of the positions they now hold (`slot_rows`: the target
    moved the path's KV there). Requests in rows `headless` are left out (the head skips them:
    `NgramPolicy.uses_head`)."""
    rows, slot_rows, next_ids = [], [], []
    req_rows, prefix_lens, seq_lens, last_rows, drafting = [], [], [], [], []
    fed = inp.input_ids.tolist()
    pool_rows = inp.req_pool_indices.tolist()
    start = 0
    decode = inp.mode.is_decode
    trees = inp.drafts.parents
    for i, (prefix, seq, count) in enumerate(zip(inp.prefix_lens, inp.seq_lens, inp.sample_counts)):
        ext = seq - prefix
        got = out.next_ids[i]
        if count == 0:
            n = 0 if decode else ext - 1
            nxt = fed[start + 1 : start + 1 + n]
        else:
            known = ext - count  # rows before the sampled ones
            nxt = fed[start + 1 : start + known + 1] + list(got)
            n = min(known + len(got), ext)
            nxt = nxt[:n]
        if n > 0 and pool_rows[i] not in headless:
            slot_rows.extend(range(start, start + n))
            if trees[i] is None:
                rows.extend(range(start, start + n))
            else:
                rows.extend([start] + [start + 1 + a for a in out.accepted_nodes[i]])
            next_ids.extend(nxt)
            if count:
                drafting.append(len(req_rows))
            req_rows.append(pool_rows[i])
            prefix_lens.append(prefix)
            seq_lens.append(prefix + n)
            last_rows.append(len(rows) - 1)
        start += ext
    if not rows:
        return None
    return _Plan(
        rows=rows, slot_rows=slot_rows, next_ids=next_ids, req_rows=req_rows, prefix_lens=prefix_lens,
        seq_lens=seq_lens, last_rows=last_rows, drafting=drafting,
    )  # fmt: skip
