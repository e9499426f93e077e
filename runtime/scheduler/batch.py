"""ScheduleBatch: the CPU-side plan of one step, and the `ModelInput` it hands the runner."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from loom.runtime.forward_batch import ForwardMode, ModelInput, StepDrafts
from loom.runtime.req import Req
from loom.runtime.sampling.info import SamplingInfo
from loom.runtime.spec import tree_depths

if TYPE_CHECKING:
    from loom.runtime.step_grammar import StepGrammar


class ScheduleBatch:
    """Requests that run together in one step. Each computes positions
    [kv_len, kv_len + extend_len): prompt tokens (a prefill), its last token (a decode step),
    or its last token and `draft_ids` (a verify step; a draft tree's nodes fill those KV
    columns in node order, at positions by depth). `is_decode` says which owner built it."""

    def __init__(self, reqs: list[Req], is_decode: bool):
        self.reqs = reqs
        self.is_decode = is_decode
        self.model_input: ModelInput | None = None
        # KV slots of the step's positions, in order (a decode step allocates them at once;
        # otherwise each request's `new_slots`)
        self.out_cache_loc: np.ndarray | None = None
        # the step's grammar owner (`build_input`) and the rows it left lazy
        self.grammar: StepGrammar | None = None
        self.lazy_rows = None

    def __len__(self) -> int:
        return len(self.reqs)

    @property
    def mode(self) -> ForwardMode:
        if self.is_decode and all(r.extend_len == 1 for r in self.reqs):
            return ForwardMode.DECODE
        return ForwardMode.EXTEND  # prompts, jump-forward text and draft verification

    def _slots(self) -> np.ndarray:
        """The step's KV slots in order: the decode allocation's, else each request's
        `new_slots` (one request's own array as it is: the forward only reads them)."""
        if self.out_cache_loc is not None:
            return self.out_cache_loc
        if len(self.reqs) == 1:
            return self.reqs[0].new_slots
        return np.concatenate([r.new_slots for r in self.reqs])

    def build_input(self, vocab_size: int, grammar: StepGrammar | None = None) -> ModelInput:
        """The step's tokens, positions and KV slots, what each request samples and with
        which parameters (grammar mask rows filled here, where the grammars live, by the
        step's grammar owner `grammar`; None: a fresh one)."""
        self.grammar = grammar
        self.lazy_rows = None
        if self.is_decode and all(
            r.draft_parents is None
            and r.extend_len == 1 + len(r.draft_ids)
            and not r.return_logprob
            for r in self.reqs
        ):
            return self._build_decode(vocab_size)
        return self._build_general(vocab_size)

    def _build_general(self, vocab_size: int) -> ModelInput:
        ids: list[int] = []
        positions: list[int] = []
        prefix_lens, seq_lens, counts, drafts = [], [], [], []
        lp_starts, lp_targets, top_nums = [], [], []
        sampling_reqs = []
        for req in self.reqs:
            begin, end = req.kv_len, req.kv_len + req.extend_len
            draft = req.draft_ids
            ids.extend(req.tokens(begin, end - len(draft)))
            ids.extend(draft)
            if req.draft_parents is None:
                positions.extend(range(begin, end))
            else:  # a draft tree: node i at the last real token's position + 1 + its depth
                last = end - len(draft) - 1
                positions.extend(range(begin, last + 1))
                positions.extend(last + 1 + d for d in tree_depths(req.draft_parents))
            prefix_lens.append(begin)
            seq_lens.append(end)
            real_end = end - len(draft)
            if req.samples_at(real_end):
                counts.append(1 + len(draft))
                sampling_reqs.append(req)
            else:
                assert not draft, "draft tokens for a request that does not sample"
                counts.append(0)
            drafts.append(draft)
            start, targets = _input_logprob_span(req, begin, real_end)
            lp_starts.append(start)
            lp_targets.append(targets)
            top_nums.append(req.logprob.top_num if req.return_logprob else None)
        sampling = None
        if sampling_reqs:
            sampling = SamplingInfo.from_reqs(
                sampling_reqs,
                vocab_size,
                drafts=[r.draft_ids for r in sampling_reqs],
                parents=[r.draft_parents for r in sampling_reqs],
                draft_probs=[r.draft_probs for r in sampling_reqs],
            )
            lazy_ok = not sampling.trees and not any(r.return_logprob for r in self.reqs)
            self.lazy_rows = self._grammar(vocab_size).rows(sampling_reqs, sampling, lazy_ok)
        return self._model_input(
            self.mode, ids, positions, seq_lens, prefix_lens, counts, drafts, sampling,
            top_nums, lp_starts, lp_targets, [r.draft_parents for r in self.reqs],
        )  # fmt: skip

    def _build_decode(self, vocab_size: int) -> ModelInput:
        """`build_input` for a decode step whose requests feed their last token and a draft
        chain or none (no tree, no logprobs): each request computes positions kv_len ..
        kv_len + len(draft) and samples 1 + len(draft) rows unless it is finishing. The same
        ModelInput as `_build_general`, with a third of the per-request work (a batch-1
        decode step's build is ~50 us of the ~300 outside its forward)."""
        reqs = self.reqs
        ids, positions, prefix_lens, seq_lens, counts, sampling_reqs = [], [], [], [], [], []
        chains = False
        for req in reqs:
            pos = req.kv_len
            draft = req.draft_ids
            ids.extend(req.tokens(pos, pos + 1))
            prefix_lens.append(pos)
            if draft:  # a verify: the chain after the last token
                chains = True
                ids.extend(draft)
                positions.extend(range(pos, pos + 1 + len(draft)))
            else:
                positions.append(pos)
            seq_lens.append(pos + 1 + len(draft))
            if req.samples_at(pos + 1):
                counts.append(1 + len(draft))
                sampling_reqs.append(req)
            else:
                assert not draft, "draft tokens for a request that does not sample"
                counts.append(0)
        sampling = None
        if sampling_reqs:
            drafts = [r.draft_ids for r in sampling_reqs] if chains else None
            sampling = SamplingInfo.from_reqs(sampling_reqs, vocab_size, drafts=drafts)
            # no trees, no logprobs here: greedy grammar rows are masked only if needed
            self.lazy_rows = self._grammar(vocab_size).rows(sampling_reqs, sampling, lazy_ok=True)
        b = len(reqs)
        mode = ForwardMode.EXTEND if chains else ForwardMode.DECODE  # `self.mode`, known here
        return self._model_input(
            mode, ids, positions, seq_lens, prefix_lens, counts, [r.draft_ids for r in reqs],
            sampling, [None] * b, [0] * b, [None] * b, [None] * b,
        )  # fmt: skip

    def _grammar(self, vocab_size: int) -> StepGrammar:
        if self.grammar is None:  # a batch built without the scheduler's owner (tests, tools)
            from loom.runtime.step_grammar import StepGrammar

            self.grammar = StepGrammar(None, vocab_size)
        return self.grammar

    def _model_input(
        self, mode, ids, positions, seq_lens, prefix_lens, counts, drafts, sampling,
        top_nums, lp_starts, lp_targets, parents,
    ) -> ModelInput:  # fmt: skip
        """The one place a step's `ModelInput` is assembled, from either builder's lists: the
        index vectors are views of one numpy int64 array (one allocation per step); the torch
        runner takes them (and the slots) with `torch.as_tensor`, zero-copy."""
        t, b = len(ids), len(self.reqs)
        rows = [r.req_pool_idx for r in self.reqs]
        index = np.array(ids + positions + rows + seq_lens, dtype=np.int64)
        self.model_input = ModelInput(
            mode=mode,
            input_ids=index[:t],
            positions=index[t : 2 * t],
            out_cache_loc=self._slots(),
            req_pool_indices=index[2 * t : 2 * t + b],
            seq_lens=seq_lens,
            seq_lens_tensor=index[2 * t + b :],
            prefix_lens=prefix_lens,
            sample_counts=counts,
            drafts=StepDrafts(drafts, parents),
            sampling=sampling,
            logprob_top_nums=top_nums,
            input_logprob_starts=lp_starts,
            input_logprob_targets=lp_targets,
            lazy_rows=self.lazy_rows,
            prompt=not self.is_decode,
        )
        return self.model_input


def _input_logprob_span(req: Req, begin: int, end: int) -> tuple[int, list[int] | None]:
    """Prompt logprobs: the logits at position p score prompt token p+1. This step scores
    positions p in [begin, end) with max(start_len, 1) - 1 <= p < len(prompt) - 1; returns
    (index of the first such p among this step's positions, the prompt tokens scored)."""
    if not req.return_logprob:
        return 0, None
    prompt_len = len(req.origin_input_ids)
    if len(req.logprob.input_token_logprobs) >= prompt_len - req.logprob.start_len:
        return 0, None  # already computed (a resumed request)
    lo = max(begin, max(req.logprob.start_len, 1) - 1)
    hi = min(end, prompt_len - 1)
    if lo >= hi:
        return 0, None
    return lo - begin, req.origin_input_ids[lo + 1 : hi + 1]
