"""The n-gram speculator: what a request drafts each step, and how drafts meet grammars.

Per step and request: the grammar's forced text first (what jump-forward would emit; under
the grammar's mask those tokens are the only ones allowed, so verification accepts them),
then the n-gram trie's continuation, cut to the adaptive length. A constrained request's
draft is walked through its grammar by the step's grammar owner (`step_grammar.StepGrammar`:
forced text, the walk, the cut, the mask rows); a chain whose first trie token the grammar
refuses (a skip-gram's guess after a new value) is drafted again from the exact match.

Adaptive length: each request keeps a running acceptance rate per draft position (given the
draft reached it); the chance position j is accepted is the product of the rates up to j.
A request drafts the positions whose chance is at least TOKEN_COST, and its expected gain
is the sum of those chances (+1 per forced token). A verify step costs more than a decode
step for the whole batch, growing with the batch size and the draft length (one draft
already switches each request's attention to the multi-row path; every further row costs
like a prefill row); `extra_cost` is the bundled model's fit of that cost
(`benchmarks/bench_verify_cost.py`; docs/benchmarks.md, "Figures moved out of module
docstrings"), and a larger model's is measured for it (`cost.py`, `set_verify_cost`: on
SmolLM2-135M a 7-token verify costs half the decode steps the bundled fit charges).
The batch verifies when the gains of all its requests pay b x extra_cost (b tokens per
decode step), else the step decodes plainly. Every PROBE_EVERY steps a request drafts its
full length, verified whatever its expected gain, to re-measure. Decode batches of
`--speculative-disable-by-batch-size` requests or more draft nothing (grammar requests there
take the jump-forward path).

Openings: a request's first draft rides its prefill forward (`draft_prefill`: forced text and
a chain, fed after the prompt and verified there, a few more rows of a forward that runs
anyway), so a schema's opening keys cost no step of their own. That draft and the first
OPENING_STEPS drafts after it are sized by server-wide rates per opening step rather than the
request's own (an answer's first words are often what no history predicts: a name, a number).
"""

from __future__ import annotations

import math
from collections import deque

from loom.runtime.spec import Drafter, DraftTree, tree_depths
from loom.runtime.spec.ngram import MAX_PROMPT_TOKENS, NgramLookup, NgramState
from loom.runtime.spec.ngram_copy import PromptCopy
from loom.runtime.spec.stats import AcceptanceStats
from loom.runtime.step_grammar import StepGrammar

TOKEN_COST = 0.05
LEARN_QUEUE = 64
LEARN_PER_STEP = 16  # tokens of finished requests the trie learns per drafting step
PROBE_EVERY = 16
# calibration of the running rates' chances (`_calibrated`): decayed sums over verified chains,
# started at CALIB_PRIOR pseudo-verifies that got what was expected (a factor of 1)
CALIB_DECAY = 0.02
CALIB_PRIOR = 4.0


def extra_cost(batch_size: int, longest_draft: int) -> float:
    """A verify step's cost beyond a decode step's, in decode steps (least-squares fit to the
    table above and batch 3's five rounds, weighted by rounds: within 27% from batch 2; at
    batch 1 it is 0.06-0.26 decode steps dearer than measured, where the run-to-run spread
    under load was as large. Session 5's fit had 0.167 a request where today's has 0.045)."""
    b, d = batch_size, longest_draft
    return 0.218 + 0.045 * b + 0.083 * d + 0.028 * b * d


RATE_DECAY = 0.3
PRIOR_DECAY = 0.05
OPENING_DECAY = 0.5  # one update per request: a fresh server learns its openings fast
OPENING_STEPS = 2  # drafts after the prefill's that use the opening rates
# a prefill draft position pays when its chance of acceptance is above this: one more row in
# a forward that runs anyway (~0.1 decode step) against ~0.3 of a verify step per accepted token
PREFILL_TOKEN_COST = 0.2


class NgramSpeculator(Drafter):
    """`grammar`: the step's grammar owner (`StepGrammar`; None: one of its own, with lazy
    greedy rows where no other rank receives the step's plan)."""

    def __init__(self, args, tokenizer, vocab_size: int, eos_token_ids, grammar=None):
        self.num_draft = args.effective_num_draft_tokens - 1
        self.disable_batch_size = args.speculative_disable_by_batch_size
        self.ngram = NgramLookup(
            args.speculative_ngram_min_match_window_size,
            args.speculative_ngram_max_match_window_size,
            # a draft never reads deeper than the match window + the draft budget, so the
            # trie stores no longer branches (fewer nodes to touch per token seen)
            min(args.speculative_ngram_branch_length, self.num_draft),
            args.speculative_ngram_capacity,
            args.speculative_ngram_match_type,
        )
        # the words an answer copies from its prompt (a JSON value): needs token spellings
        self.ngram.copy = PromptCopy(tokenizer) if tokenizer is not None else None
        # draft trees when the breadth allows more than one child per node
        self.breadth = (
            args.speculative_ngram_min_bfs_breadth,
            args.speculative_ngram_max_bfs_breadth,
        )
        self.grammar = grammar or StepGrammar(
            tokenizer, vocab_size, eos_token_ids, lazy=args.world_size == 1
        )
        self.stats = AcceptanceStats(self.num_draft)
        self.finished: deque = deque(maxlen=LEARN_QUEUE)  # finished requests not yet learnt
        # a new request's per-position rates start from every request's so far (a slower
        # running average), not from 1.0: a batch that shrinks under the size threshold then
        # drafts what has been paying, instead of full-length drafts for every request in it
        self.prior_rates = [1.0] * self.num_draft
        # the opening of an answer is not its middle (a copy's first words are a name the
        # prompt does not hold; a schema's are forced): the draft riding the prefill and the
        # first OPENING_STEPS drafts after it use server-wide rates of their own, per step
        self.opening_rates = [[1.0] * self.num_draft for _ in range(1 + OPENING_STEPS)]
        self.opening_ct = [0] * (1 + OPENING_STEPS)
        self.batch_size = 1  # of the step being drafted (`enabled_for`)
        # per draft position: what the requests' rates expected verified chains to get
        # accepted there (the chance, summed) and what they got (`_calibrated`)
        self.calib_expected = [CALIB_PRIOR] * self.num_draft
        self.calib_got = [CALIB_PRIOR] * self.num_draft
        # the verify cost table (`set_verify_cost`); None: the bundled fit, `extra_cost`
        self.cost = None

    def set_verify_cost(self, cost) -> bool:
        self.cost = cost
        return True

    def _extra(self, batch_size: int, longest: int, context: float | None = None) -> float:
        # looked up per call: tests replace the module's `extra_cost`; a measured table
        # (`cost.VerifyCost`, `prices_context`; not imported here: an import cycle) prices
        # the batch's context too (`context`: mean tokens a request)
        if context is not None and getattr(self.cost, "prices_context", False):
            return self.cost(batch_size, longest, context)
        return (self.cost or extra_cost)(batch_size, longest)

    def enabled_for(self, batch_size: int) -> bool:
        # the step's drafting requests share one learning budget (`_learn_finished`)
        self.batch_size = max(1, batch_size)
        return batch_size < self.disable_batch_size

    def skip(self, reqs: list) -> None:
        for req in reqs:
            if req.spec_state is None:
                req.spec_state = NgramState(self.num_draft)
                req.spec_state.rates = list(self.prior_rates)
            req.spec_state.skipped = True
        self.stats.skipped += len(reqs)

    def draft(self, req, room: int, free_drafts: bool = True) -> list[int]:
        state = req.spec_state
        if state is None:
            state = req.spec_state = NgramState(self.num_draft)
            state.rates = list(self.prior_rates)  # what drafts have earned so far, server-wide
        state.opening = -1
        if state.shadow is not None:
            self._score_shadow(req, state)
        if state.skipped:
            self.ngram.catch_up(req, state)
        if not free_drafts:
            self.stats.skipped += 1
            return []
        self._learn_finished()
        budget = min(room, self.num_draft)
        forced = self.grammar.forced(req, budget)
        gains = self._gains(state, len(req.output_ids))[: max(0, budget - len(forced))]
        if self.breadth[1] > 1 and gains:
            return self._draft_tree(req, state, forced, gains, budget)
        if not gains and budget > len(forced) and req.grammar is None:
            # the rates allow no draft (the first position's chance fell under TOKEN_COST):
            # the trie's chain is kept as a shadow, scored against the token the step gets
            # (`_score_shadow`), so the rates rise again when the trie starts matching
            # instead of waiting for the next probe (PROBE_EVERY steps). On Spec-Bench's
            # held-out rows 249 of 476 SmolLM2 steps drafted nothing for this reason before.
            shadow = self.ngram.propose(
                req, state, budget - len(forced), after=forced, own=self._own_first(req)
            )
            if shadow:
                state.shadow = (forced + shadow, len(req.output_ids), state.opening, len(forced))
        ngram = self.ngram.propose(req, state, len(gains), after=forced, own=self._own_first(req))
        draft = forced + ngram
        if req.grammar is not None and draft:
            draft = self.grammar.walk(req, draft)
            if ngram and len(draft) == len(forced):
                # the grammar refused the trie's first token: a skip-gram's guess (a sibling
                # value's continuation after `28`, prompt text after `27`) where the exact
                # match's (`,` after `8`) may be legal
                exact = self.ngram.propose(req, state, len(gains), after=forced, skip=False)
                if exact and exact != ngram:
                    ngram = exact
                    draft = self.grammar.walk(req, forced + exact)
        req.draft_forced = min(len(forced), len(draft))
        # each position's chance of acceptance (forced text: 1), for the batch's cut
        state.gains = ([1.0] * len(forced) + gains[: len(ngram)])[: len(draft)]
        if state.raw is not None:
            state.raw = state.raw[: max(0, len(draft) - len(forced))]
        state.expected = sum(state.gains)
        return draft

    def _own_first(self, req) -> bool:
        """Whether `req`'s chain follows its own tokens before the trie: a free request's
        decode steps (a constrained one keeps the trie's schema-aware path; the prefill's
        draft, an answer's first words, what earlier answers opened with). Held-out
        Spec-Bench rows, SmolLM2 f32, replayed: 1.36 -> 1.42 tokens per decode step's time;
        docs/benchmarks.md, "Issue 33: where NGRAM's drafts are lost"."""
        return req.grammar is None and bool(req.output_ids)

    def draft_prefill(self, req, room: int) -> list[int]:
        """Forced text, then the trie's chain, verified by the prefill forward itself: a
        constrained request gets the schema's opening keys (and a copy its first words)
        without a verify step of their own. A draft token there costs one more row of a
        forward that runs anyway, so the chain runs while the server-wide acceptance of
        prefill drafts at that position stays above PREFILL_TOKEN_COST (a separate rate:
        the first tokens of an answer are not the middle of one)."""
        state = req.spec_state
        if state is None:
            state = req.spec_state = NgramState(self.num_draft)
            state.rates = list(self.prior_rates)
        self._learn_finished()
        budget = min(room, self.num_draft)
        if budget <= 0:
            return []
        forced = self.grammar.forced(req, budget)
        n = len(self._opening_gains(state, 0, PREFILL_TOKEN_COST)[: budget - len(forced)])
        ngram = self.ngram.propose(req, state, n, after=forced) if n else []
        draft = forced + ngram
        if req.grammar is not None and draft:
            draft = self.grammar.walk(req, draft)
        req.draft_forced = min(len(forced), len(draft))
        return draft

    def _opening_gains(self, state: NgramState, step: int, cost: float) -> list[float]:
        """Gains by the server-wide rates of opening step `step` (every PROBE_EVERY-th
        request drafts its full length there, to re-measure)."""
        state.opening = step
        self.opening_ct[step] += 1
        if self.opening_ct[step] % PROBE_EVERY == 0:
            return [float("inf")] * self.num_draft
        gain, gains = 1.0, []
        for rate in self.opening_rates[step]:
            gain *= rate
            if gain < cost:
                break
            gains.append(gain)
        return gains

    def _draft_tree(self, req, state, forced, gains, budget) -> list[int] | DraftTree:
        """Forced text as a chain, the trie's tree below it (as deep as the positions that
        pay, as many nodes as the budget), cut per branch by the grammar."""
        f = len(forced)
        tokens, parents = self.ngram.propose_tree(
            req, state, budget - f, len(gains), self.breadth, after=forced
        )
        depth = 1 + max(tree_depths(parents), default=-1)
        state.expected = f + sum(gains[:depth])
        state.gains = None  # a tree: verified whole or not at all
        state.raw = None  # the calibration learns from chains
        tokens = forced + tokens
        parents = [i - 1 for i in range(f)] + [f - 1 if p < 0 else f + p for p in parents]
        if req.grammar is not None and tokens:
            tokens, parents = self.grammar.walk_tree(req, tokens, parents)
        req.draft_forced = min(f, len(tokens))  # the forced chain is never cut before a node
        return DraftTree(tokens, parents) if tokens else []

    def _gains(self, state: NgramState, output_len: int) -> list[float]:
        """The chance each draft position is accepted, for the positions worth drafting."""
        state.steps += 1
        state.raw = None
        # an opening step: among a request's first drafts, near the answer's start (not the
        # first drafts of a request that waited in a batch too large to draft)
        if state.steps <= OPENING_STEPS and output_len <= state.steps * (1 + self.num_draft):
            return self._opening_gains(state, state.steps, TOKEN_COST)
        if state.steps % PROBE_EVERY == 0:  # verified whatever the batch (worth_verifying)
            return [float("inf")] * self.num_draft
        gain, raw, gains = 1.0, [], []
        for j, rate in enumerate(state.rates):
            gain *= rate
            chance = self._calibrated(j, gain)
            if chance < TOKEN_COST:
                break
            raw.append(gain)
            gains.append(chance)
        state.raw = raw
        return gains

    def _calibrated(self, j: int, chance: float) -> float:
        """A request's chance of position j by its running rates, times what verified chains
        got accepted there over what those rates expected (server-wide, decayed). The rates
        jump after a hit (decay 0.3), and a chain is verified when they are high, so they
        promise more than verifies get: on Spec-Bench's held-out rows (SmolLM2 Q4_1) 7-token
        chains expected 2.07 accepted tokens and got 1.21, and the gate verified chains that
        did not pay for the verify."""
        return min(1.0, chance * self.calib_got[j] / self.calib_expected[j])

    def _learn_calibration(self, raw: list[float], verified: int, accepted: int) -> None:
        keep = 1.0 - CALIB_DECAY
        for j, chance in enumerate(raw[:verified]):
            self.calib_expected[j] = keep * self.calib_expected[j] + chance
            self.calib_got[j] = keep * self.calib_got[j] + (1.0 if accepted > j else 0.0)

    def worth_verifying(self, reqs: list, drafts: list[list[int]]) -> bool:
        """Whether the batch verifies, and how deep: the cut d (every chain cut to at most d
        tokens, in place) that maximises the batch's expected tokens per decode step of
        time, (b + expected accepted) / (b x (1 + extra_cost(b, d))); none of them above a
        plain decode step's b / b: decode plainly. (Tokens per time, not tokens less cost:
        accepted 0.4 for 0.2 extra beats 1.5 for 1.2 extra, 1.17 against 1.14 a step.)"""
        b = len(reqs)
        if self._cut(reqs, drafts, b):
            return True
        # the step decodes plainly: each chain is kept as a shadow, scored against the tokens
        # the request gets instead (`_score_shadow`), so rates that stopped a request (or an
        # opening step) from drafting still learn, free, and rise again when drafts would pay
        for r, d in zip(reqs, drafts):
            if d and isinstance(d, list) and r.spec_state is not None:
                state = r.spec_state
                state.shadow = (d, len(r.output_ids), state.opening, r.draft_forced)
                state.opening = -1
        return False

    def on_verified(self, req, drafted: int, accepted: int) -> None:
        forced = req.draft_forced
        self.stats.record(drafted, accepted, forced)
        state = req.spec_state
        if state is None:
            return
        opening, state.opening = state.opening, -1
        if state.raw is not None and opening < 0 and accepted >= forced:
            self._learn_calibration(state.raw, drafted - forced, accepted - forced)
        state.raw = None
        self._learn_rates(state, opening, drafted, accepted, forced)

    def _cut(self, reqs: list, drafts: list, b: int) -> bool:
        longest = max(map(len, drafts))
        context = sum(r.seq_len for r in reqs) / b
        gains = [r.spec_state.gains if d else [] for r, d in zip(reqs, drafts)]
        if any(g is None for g in gains) or any(math.isinf(x) for g in gains for x in g):
            # a tree, or a probe (drafted in full whatever it is expected to earn)
            gain = sum(r.spec_state.expected for r, d in zip(reqs, drafts) if d)
            return gain >= b * self._extra(b, longest, context)
        by_pos = [0.0] * longest
        for g in gains:
            for j, x in enumerate(g):
                by_pos[j] += x
        best, best_d, total = 1.0 + 1e-9, 0, 0.0
        for d in range(1, longest + 1):
            total += by_pos[d - 1]
            value = (b + total) / (b * (1.0 + max(0.0, self._extra(b, d, context))))
            if value > best:
                best, best_d = value, d
        if best_d == 0:
            return False
        if best_d < longest:
            for r, d, g in zip(reqs, drafts, gains):
                if len(d) > best_d:
                    self.grammar.cut(r, d, best_d)
                    r.spec_state.expected = sum(g[:best_d])
        return True

    def _score_shadow(self, req, state: NgramState) -> None:
        """A chain drafted but not verified (`worth_verifying`): its positions up to the
        first miss among the tokens the request got since are known, and teach the rates as
        a verify would (not the reported acceptance: nothing was verified)."""
        draft, start, opening, forced = state.shadow
        state.shadow = None
        got = req.output_ids[start : start + len(draft)]
        known = len(got)
        if known == 0:
            return
        accepted = 0
        while accepted < known and draft[accepted] == got[accepted]:
            accepted += 1
        # every position up to `known` is decided: accepted ones, then the first miss if any
        self._learn_rates(state, opening, known, accepted, forced)

    def _learn_rates(self, state, opening: int, drafted: int, accepted: int, forced: int) -> None:
        if accepted < forced:
            return
        if opening >= 0:
            rates = self.opening_rates[opening]
            for j in range(min(drafted - forced, accepted - forced + 1, len(rates))):
                hit = 1.0 if j < accepted - forced else 0.0
                rates[j] += OPENING_DECAY * (hit - rates[j])
            if opening == 0:
                return  # the request's own rates are for its drafts after the opening
        rates, prior = state.rates, self.prior_rates
        for j in range(drafted - forced):
            if j > accepted - forced or j >= len(rates):
                break
            hit = 1.0 if j < accepted - forced else 0.0
            rates[j] += RATE_DECAY * (hit - rates[j])
            prior[j] += PRIOR_DECAY * (hit - prior[j])

    def on_finished(self, req) -> None:
        """Queue `req` for the trie: it learns finished requests lazily, LEARN_PER_STEP
        tokens per drafting step (shared by the step's requests: LEARN_PER_STEP // b each
        at batch b, at least one), so batches too large to draft never pay for it and a
        drafting step pays a bounded share whatever its size (the last LEARN_QUEUE requests
        are kept)."""
        if req.spec_state is not None:
            req.spec_state.own = None  # drafts no more: its own n-grams go (`ngram_own`)
            self.finished.append(req)

    def _learn_finished(self) -> None:
        budget = max(1, LEARN_PER_STEP // self.batch_size)
        while self.finished and budget > 0:
            req = self.finished[0]
            state = req.spec_state
            # a request that never drafted (it ran in large batches) teaches the trie its
            # output and only the prompt windows that lead into it (a whole prompt costs
            # O(prompt x depth) trie steps)
            tail = self.ngram.trie.depth if state.seen == 0 else MAX_PROMPT_TOKENS
            if not self.ngram.observe(req, state, prompt_tail=tail, limit=budget):
                return  # the budget is spent: the rest of it next step
            self.finished.popleft()
            if self.ngram.copy is not None:
                self.ngram.copy.learn(req.origin_input_ids[-MAX_PROMPT_TOKENS:], req.output_ids)
            budget -= 1 + len(req.output_ids)  # an estimate of the tokens it took

    def log_line(self) -> str:
        return self.stats.log_line() if self.stats.verify_ct else ""

    def summary(self) -> dict:
        return {**self.stats.summary(), "spec_trie_nodes": len(self.ngram.trie)}
