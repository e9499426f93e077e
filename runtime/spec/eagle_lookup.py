"""Constrained requests under a head drafter (EAGLE, EAGLE-3, Medusa): the head's draft or the
n-gram speculator's, per request step, by expected accepted length.

A schema's answer is mostly text the head guesses badly and an n-gram trie knows: keys and
punctuation (forced by the grammar, both sources get them) and, between them, the values,
copied from the prompt or recurring across answers (`"age": 3` -> `0, "city": "`). The head
drafts at most `num_steps` tokens from its own greedy context; the n-gram speculator drafts
forced text + its trie's chain (prompt and earlier answers), as long as its own measured
per-position rates say pays, with prefill drafts too. For each constrained request step both
are asked and the one with the larger expected accepted length is verified:

- n-gram: its own estimate (`state.expected`: forced + its per-request rates' products);
- head: forced + the products of the head's per-position acceptance rates on constrained
  requests (a running average of what its drafts there earned, measured here).

Either draft is cut by the grammar before verification, so the choice changes speed only.
Free (unconstrained) requests never reach this: the head drafts them.
"""

from __future__ import annotations

from loom.runtime.spec import DraftTree, tree_depths

RATE_DECAY = 0.1  # the head's constrained-request rates: a running average over verifies


class ConstrainedLookup:
    """The n-gram speculator beside a head drafter, for constrained requests only."""

    def __init__(self, args, tokenizer, vocab_size: int, eos_token_ids, positions: int):
        from loom.runtime.spec.speculator import NgramSpeculator

        self.ngram = NgramSpeculator(args, tokenizer, vocab_size, eos_token_ids)
        self.head_rates = [1.0] * max(1, positions)
        self.chosen = {"head": 0, "ngram": 0}

    def head_expected(self, forced: int, tokens: list[int], parents: list[int]) -> float:
        """forced + sum over the head's draft depths past the forced text of the products of
        its constrained-request rates."""
        depth = 1 + max(tree_depths(parents), default=-1) if tokens else 0
        gain, total = 1.0, float(forced)
        for j in range(max(0, depth - forced)):
            gain *= self.head_rates[min(j, len(self.head_rates) - 1)]
            total += gain
        return total

    def ngram_draft(self, req, room: int) -> tuple[list[int], float]:
        """The n-gram speculator's draft for `req` (walked by the grammar: `req.draft_masks`
        and `draft_forced` are its) and its expected accepted length."""
        draft = self.ngram.draft(req, room)
        if isinstance(draft, DraftTree):  # breadth > 1: keep its deepest chain's estimate
            draft = list(draft.tokens) if draft.is_chain else []
        expected = req.spec_state.expected if draft else 0.0
        return list(draft), expected

    def draft_prefill(self, req, room: int) -> list[int]:
        if req.grammar is None:
            return []
        req.draft_source = "ngram"
        return self.ngram.draft_prefill(req, room)

    def on_verified(self, req, drafted: int, accepted: int) -> None:
        """Route a verify's outcome to the source that drafted it."""
        source = getattr(req, "draft_source", None)
        req.draft_source = None
        if source == "ngram":
            self.ngram.on_verified(req, drafted, accepted)
        elif source == "head":
            forced = req.draft_forced
            if accepted < forced:
                return
            rates = self.head_rates
            for j in range(min(drafted - forced, accepted - forced + 1, len(rates))):
                hit = 1.0 if j < accepted - forced else 0.0
                rates[j] += RATE_DECAY * (hit - rates[j])

    def on_finished(self, req) -> None:
        self.ngram.on_finished(req)  # a request that drafted through the trie teaches it

    def summary(self) -> dict:
        return {
            "spec_constrained_head": self.chosen["head"],
            "spec_constrained_ngram": self.chosen["ngram"],
        }
