"""Medusa drafting beside the target: one batched call of all heads, then a sparse tree.

After each target step (`after_forward`, called by the scheduler with the target's final
hidden states in `ForwardOutput.hidden`), every request that sampled a token gets the
target's final hidden state at its last kept row (the last accepted tree node, else the row
that sampled); all heads run on those rows in one batched call, and each head's top-k
log-probabilities and ids come back to the host in one copy. They wait in a per-request-row
slot, tagged with the request length they were made for (a mismatch: no draft).

When the scheduler asks (`draft`), the tree is built on the host from those top-k lists:
node (d, r) under a path holds head d's rank-r token, scored by the sum of the heads'
log-probabilities along its path (the path's estimated probability). `best_first_tree`
takes the `--speculative-num-draft-tokens - 1` best nodes; a child never scores above its
parent, so the set is a tree. A constrained request puts the grammar's forced text first (a
chain of probability-1 drafts), the heads' tree below it (heads from depth f on), and the
whole tree is pruned by the grammar before verification (`StepGrammar.walk_tree`).

The drafts are deterministic given the context, so their q is one-hot (`DraftTree.probs`
None): at temperature > 0 the tree verification's multi-candidate rejection sampling keeps
the target distribution exactly, and a node's acceptance chance is the target's p of its
token given its rejected siblings. Verification is the target's, so any draft changes
speed, never output.
"""

from __future__ import annotations

import heapq
import logging
import time
from pathlib import Path

import torch

from loom.runtime.spec import DraftTree, HeadDrafter, tree_depths
from loom.runtime.spec.head_policy import HeadGate, NgramPolicy
from loom.runtime.spec.stats import AcceptanceStats

logger = logging.getLogger(__name__)

BUNDLED_HEADS = Path(__file__).resolve().parent.parent / "bundled" / "medusa"
# top-k kept per head. Measured on the bundled model (bench_spec chat workload, batch 1,
# 7-node trees, tokens per verify): top-1 3.15, top-2 3.32, top-3 3.39, top-4 3.49, top-7 3.49
TOPK = 4


def bundled_medusa_path(args) -> str:
    from loom.runtime.server_args import BUNDLED_MODEL_PATH

    same = Path(args.model_path).resolve() == Path(BUNDLED_MODEL_PATH).resolve()
    if not same or not (BUNDLED_HEADS / "config.json").is_file():
        raise ValueError(
            "speculative_draft_model_path: needed for --speculative-algorithm MEDUSA (heads "
            "ship only for the bundled model; train some with python -m loom.train_eagle --medusa)"
        )
    return str(BUNDLED_HEADS)


def best_first_tree(
    ids: list[list[int]], logps: list[list[float]], budget: int
) -> tuple[list[int], list[int]]:
    """The `budget` most probable nodes of the full top-k tree over the heads' lists
    (`ids[d][r]`, `logps[d][r]` sorted by rank per head d): (tokens, parents), parents first.
    Lazy best-first: popping node (d, r) under parent P offers its next sibling (d, r+1)
    under P and its first child (d+1, 0); both score no more than it does."""
    depth = len(ids)
    if budget <= 0 or depth == 0 or not ids[0]:
        return [], []
    tokens: list[int] = []
    parents: list[int] = []
    # (-score, tie, depth, rank, parent node, parent's score)
    heap = [(-logps[0][0], 0, 0, 0, -1, 0.0)]
    tie = 1
    while heap and len(tokens) < budget:
        neg, _, d, r, par, base = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(ids[d][r])
        parents.append(par)
        if r + 1 < len(ids[d]):
            heapq.heappush(heap, (-(base + logps[d][r + 1]), tie, d, r + 1, par, base))
            tie += 1
        if d + 1 < depth:
            heapq.heappush(heap, (neg - logps[d + 1][0], tie, d + 1, 0, node, -neg))
            tie += 1
    return tokens, parents


class MedusaSpeculator(HeadDrafter):
    def __init__(self, args, runner, tokenizer, vocab_size: int, eos_token_ids, grammar=None):
        from loom.runtime.spec.medusa import load_medusa_heads

        if runner is None:
            raise ValueError("speculative_algorithm: MEDUSA needs the model runner")
        path = args.speculative_draft_model_path or bundled_medusa_path(args)
        self.heads = load_medusa_heads(path, runner.model, runner.dtype, runner.device)
        self.runner = runner
        self.num_nodes = args.effective_num_draft_tokens - 1
        self.topk = min(TOPK, self.num_nodes)
        self.disable_batch_size = args.speculative_disable_by_batch_size
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos = frozenset(eos_token_ids)
        self.capture = ()  # keep the final hidden states of each forward
        self.step_capture = self.capture
        self.pending: list[tuple | None] = [None] * runner.req_to_token_pool.size
        # constrained requests: the heads' draft or the n-gram speculator's, by expected gain
        self.policy = NgramPolicy(
            args, tokenizer, vocab_size, eos_token_ids, self.heads.num_heads, grammar=grammar
        )
        self.grammar = self.policy.grammar
        self.stats = AcceptanceStats(max(self.heads.num_heads, self.policy.num_draft))
        self.gate = HeadGate(self.heads.num_heads)  # the off-switch by measured costs
        # all heads, log-softmax and top-k as one C call (runtime/spec/head_kernel.py); with
        # --cpu-forward eager, the eager heads
        self.compiled = None
        if runner.cpu_forward is not None:
            from loom.runtime.spec.head_kernel import CompiledMedusaHeads

            self.compiled = CompiledMedusaHeads.build(self.heads)
        logger.info(
            "MEDUSA heads from %s: %d heads, trees of %d nodes (top-%d per head)",
            path, self.heads.num_heads, self.num_nodes, self.topk,
        )  # fmt: skip

    # ------------------------------------------------------------ scheduler side
    def enabled_for(self, batch_size: int) -> bool:
        enabled = batch_size < self.disable_batch_size and self.gate.enabled(
            batch_size, self.heads.num_heads
        )
        # keep the target's final hidden states only for steps that may draft (the compiled
        # CPU forward returns them too, when the capture is (); larger steps skip the copy)
        # and hold a request that uses the heads
        self.policy.enabled_for(batch_size)
        self._head_capture(enabled)
        return enabled

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
        if not self._uses_head(req):  # a constrained request the heads skip: n-gram chains
            ngram, expected = self.policy.ngram_draft(req, room)
            return self.policy.take_ngram(req, ngram, expected, req.draft_forced)
        if pending is None or pending[0] != req.seq_len:
            return []
        _, ids, logps = pending
        budget = min(room, self.num_nodes)
        ngram, ngram_expected, ngram_forced = [], 0.0, 0
        if req.grammar is not None:  # the n-gram speculator's draft, walked by the grammar
            ngram, ngram_expected = self.policy.ngram_draft(req, room)
            ngram_forced = req.draft_forced
        forced = self.grammar.forced(req, budget)
        f = len(forced)
        tokens, parents = best_first_tree(ids[f:], logps[f:], budget - f)
        tokens = forced + tokens
        parents = [i - 1 for i in range(f)] + [f - 1 if p < 0 else f + p for p in parents]
        if req.grammar is not None:
            if ngram and ngram_expected >= self.policy.head_expected(f, tokens, parents):
                self.policy.take_ngram(req, ngram, ngram_expected, ngram_forced)
                return DraftTree(ngram, list(range(-1, len(ngram) - 1)))
            self.policy.chosen["head"] += 1
            req.draft_source = "head"
            req.draft_expected = self.policy.head_expected(f, tokens, parents)
            if tokens:
                tokens, parents = self.grammar.walk_tree(req, tokens, parents)
        else:
            req.draft_source = "free"
            req.draft_expected = sum(self.gate.gains(1 + max(tree_depths(parents), default=-1)))
        req.draft_forced = min(f, len(tokens))
        return DraftTree(tokens, parents) if tokens else []

    # ------------------------------------------------------------ runner side
    @torch.inference_mode()
    def after_forward(self, inp, out) -> None:
        captured = out.hidden
        if captured is None or len(inp.seq_lens) >= self.disable_batch_size:
            return  # this step kept no hidden states, or its batch is too large to draft
        t0 = time.perf_counter()
        rows, pool_rows, lengths = [], [], []
        start = 0
        pool = inp.req_pool_indices.tolist()
        for i, (prefix, seq, count) in enumerate(
            zip(inp.prefix_lens, inp.seq_lens, inp.sample_counts)
        ):
            ext = seq - prefix
            if count and pool[i] not in self.policy.headless:
                nodes = out.accepted_nodes[i] if out.accepted_nodes else []
                kept = 1 + nodes[-1] if nodes else 0  # row of the last accepted node
                rows.append(start + ext - count + kept)
                pool_rows.append(pool[i])
                # the request then holds its committed rows + the kept ones + the sampled token
                lengths.append(seq - count + len(out.next_ids[i]) + 1)
            start += ext
        if not rows:
            return
        final = captured[0]
        hidden = final.index_select(0, torch.tensor(rows, device=final.device))
        if self.compiled is not None:
            logp, ids = self.compiled.run(hidden, self.topk)  # [b, k, K]
        else:
            logits = self.heads.draft_logits(hidden)  # [k, b, Vd]
            logp, ids = logits.log_softmax(-1).topk(self.topk, dim=-1)  # [k, b, K]
            if self.heads.draft_ids is not None:
                ids = self.heads.draft_ids[ids]
            logp, ids = logp.transpose(0, 1), ids.transpose(0, 1)
        logp_l = logp.tolist()
        ids_l = ids.tolist()
        for b, row in enumerate(pool_rows):
            self.pending[row] = (lengths[b], ids_l[b], logp_l[b])
        self._spent(inp, t0)
