"""Speculative decoding: drafters propose tokens, one target forward verifies them.

`Drafter` is the interface the scheduler sees (the decode owner asks for drafts, result
processing reports what was accepted); `factory.create_drafter(args, ...)` builds the one
named by `--speculative-algorithm`. The package holds the shared types only and imports none
of its modules: the drafters import it, so importing them from here would be a cycle.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any


@dataclass
class DraftTree:
    """A draft tree: node i holds `tokens[i]`; its parent is `parents[i]` (-1: the request's
    last real token, else an earlier node: parents come first). The verify step feeds the last
    real token at position kv_len and node i at kv_len + 1 + depth(i); each node attends to
    its ancestors only. `probs` (optional, [n, vocab]): the draft distribution each node's
    token was drawn from (None: a deterministic drafter, q one-hot)."""

    tokens: list[int]
    parents: list[int]
    probs: Any = None

    def __post_init__(self):
        assert len(self.tokens) == len(self.parents), "one parent per draft token"
        assert all(-1 <= p < i for i, p in enumerate(self.parents)), "parents come first"

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))


def tree_depths(parents: list[int]) -> list[int]:
    """Depth of each node (a child of the last real token has depth 0)."""
    depths: list[int] = []
    for p in parents:
        depths.append(0 if p < 0 else depths[p] + 1)
    return depths


class Drafter(ABC):
    """The scheduler's side of speculation, one seam: it asks for drafts (`draft`,
    `draft_prefill`), puts them in the step's `ModelInput` (`drafts`, a `StepDrafts`)
    with `step_capture` (the layers whose hidden states the forward keeps for the drafter),
    and after the forward hands the drafter the step and its output (`after_forward`, the
    captured hidden states in `ForwardOutput.hidden`); result processing reports what was
    accepted (`on_verified`, `on_finished`). Nothing is injected into the runner or written
    onto the model."""

    # what the next forward keeps for this drafter (None: nothing; (): the final hidden
    # states only; else those and the residual stream after each listed layer)
    step_capture: tuple[int, ...] | None = None

    def after_forward(self, inp, out) -> None:
        """After each forward of the scheduler's, before its results are processed: a
        model-based drafter reads the target's hidden states (`out.hidden`) and drafts the
        next step. Default: nothing."""
        return None

    @abstractmethod
    def draft(self, req, room: int, free_drafts: bool = True) -> list[int] | DraftTree:
        """Tokens to verify after `req`'s current tokens (at most `room`): a chain, or a
        `DraftTree`. `free_drafts`: False when the batch is too large for speculation to pay
        (return nothing then; the call lets the drafter count it). A constrained request's
        drafts come with `req.draft_masks` (one grammar row after the last real token, then
        one after each node)."""

    def draft_prefill(self, req, room: int) -> list[int]:
        """A chain (at most `room` tokens) to verify in the forward that prefills `req`: its
        tokens are fed after the prompt, and that forward samples at each of them as a verify
        step would (a tree would need the prompt's rows under a tree mask: chains only).
        Default: none (a head drafter needs the target's hidden states of a forward first)."""
        return []

    def skip(self, reqs: list) -> None:
        """A decode batch too large to draft (`enabled_for` False): the requests in it draft
        nothing this step (one call per batch; the default asks `draft` per request)."""
        for req in reqs:
            self.draft(req, 0, free_drafts=False)

    def enabled_for(self, batch_size: int) -> bool:
        """Whether a decode batch of this size drafts (if not, grammar requests in it take
        the jump-forward path)."""
        return True

    def worth_verifying(self, reqs: list, drafts: list[list[int]]) -> bool:
        """Whether this decode batch should verify these drafts (a verify step is dearer than a
        decode step for every request in it, drafting or not)."""
        return True

    def on_verified(self, req, drafted: int, accepted: int) -> None:
        """A verify step accepted `accepted` of `drafted` draft positions of `req` (a tree's
        positions are its depths: `drafted` = its deepest node's depth + 1)."""
        return None

    def on_finished(self, req) -> None:
        """`req` finished: let the drafter learn its last tokens."""
        return None

    def set_verify_cost(self, cost) -> bool:
        """Price verify steps by `cost` (a `cost.VerifyCost`: extra decode steps by batch and
        draft length, measured for this model). False: this drafter has no cost model."""
        return False

    def summary(self) -> dict:
        return {}

    def log_line(self) -> str:
        """Acceptance so far, for the scheduler's periodic log line ("" = nothing to say)."""
        return ""


class HeadDrafter(Drafter):
    """A drafter that runs a trained head beside the target (EAGLE, EAGLE-3, Medusa): it keeps
    `stats` (an AcceptanceStats) and `draft_seconds` (head time, for bench_spec's step split;
    `draft_decode_seconds` the part after decode / verify steps, steps whose every fed row
    samples: prefill catch-ups aside).
    It composes two policies: `policy` (a `head_policy.NgramPolicy`: constrained requests get
    the head's draft or the n-gram speculator's, and their prefill the latter's) and `gate`
    (a `head_policy.HeadGate`: whether a batch's drafts are worth a verify, by measured
    costs). Grammar work (forced text, the walk and cut with every draft position's mask) is
    the step's grammar owner's (`grammar`, a `step_grammar.StepGrammar`)."""

    stats: Any
    policy: Any
    gate: Any
    grammar: Any
    draft_seconds: float = 0.0
    draft_decode_seconds: float = 0.0

    runner: Any  # the target's ModelRunner (its forward time prices the head's)

    def set_verify_cost(self, cost) -> bool:
        self.gate.set_cost(cost)
        self.policy.set_verify_cost(cost)
        return True

    def _capture(self, layers) -> None:
        """What the target's next forward keeps (`step_capture`)."""
        self.step_capture = layers

    def _spent(self, inp, t0: float) -> None:
        """Count the head's wall time since `t0` (perf_counter) after the step `inp`."""
        dt = time.perf_counter() - t0
        self.draft_seconds += dt
        if self.policy.priced:  # constrained requests that use the head pay for it
            self.policy.charge(inp.req_pool_indices.tolist(), dt)
        if all(s - p == c for s, p, c in zip(inp.seq_lens, inp.prefix_lens, inp.sample_counts)):
            self.draft_decode_seconds += dt

    capture: Any  # what the target's forward keeps for the head (`_capture`)

    def worth_verifying(self, reqs: list, drafts: list) -> bool:
        if all(
            isinstance(d, list) and (not d or r.draft_source == "ngram")
            for r, d in zip(reqs, drafts)
        ):  # n-gram chains only (constrained requests the head skips): the speculator's cut
            return self.policy.worth_verifying(reqs, drafts)
        expected = [r.draft_expected if d else 0.0 for r, d in zip(reqs, drafts)]
        return self.gate.worth(expected, max(map(len, drafts)))

    def _head_capture(self, on: bool) -> None:
        """The next forward keeps the head's features when it may draft (`on`) and a request
        in it may use the head (`policy.uses_head`; none decided yet counts as may)."""
        lk = self.policy
        self._capture(self.capture if on and (lk.headed or not lk.headless) else None)

    def _uses_head(self, req) -> bool:
        """`policy.uses_head`; a request that does turns this step's capture on."""
        use = self.policy.uses_head(req)
        if use:
            self._capture(self.capture)
        return use

    def draft_prefill(self, req, room: int) -> list[int]:
        """A constrained request's prefill verifies the n-gram speculator's chain (forced
        keys, the trie's values); a free one drafts nothing there (the head needs the
        prefill's features first). A prefill whose requests the head skips keeps no features."""
        self._uses_head(req)
        self._head_capture(True)
        return self.policy.draft_prefill(req, room)

    def on_verified(self, req, drafted: int, accepted: int) -> None:
        self.stats.record(drafted, accepted, req.draft_forced)
        if req.draft_source == "free":
            self.gate.record(drafted, accepted)
        self.policy.on_verified(req, drafted, accepted, self.runner.last_model_seconds)

    def on_finished(self, req) -> None:
        self.policy.on_finished(req)

    def log_line(self) -> str:
        return self.stats.log_line() if self.stats.verify_ct else ""

    def summary(self) -> dict:
        return {
            **self.stats.summary(),
            "spec_draft_seconds": round(self.draft_seconds, 4),
            "spec_draft_decode_seconds": round(self.draft_decode_seconds, 4),
            **self.policy.summary(),
        }
