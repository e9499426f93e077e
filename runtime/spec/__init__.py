"""Speculative decoding: drafters propose tokens, one target forward verifies them.

`Drafter` is the interface the scheduler sees (the decode owner asks for drafts, result
processing reports what was accepted); `create_drafter(args, ...)` builds the one named by
`--speculative-algorithm` (lazy imports: nothing here loads unless speculation is on).
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class Drafter(ABC):
    @abstractmethod
    def draft(self, req, room: int, free_drafts: bool = True) -> list[int]:
        """Tokens to verify after `req`'s current tokens (at most `room`). `free_drafts`:
        False when the batch is too large for speculation to pay (return nothing then; the
        call lets the drafter count it). A constrained request's drafts come with
        `req.draft_masks`."""

    def enabled_for(self, batch_size: int) -> bool:
        """Whether a decode batch of this size drafts (if not, grammar requests in it take
        the jump-forward path)."""
        return True

    def worth_verifying(self, reqs: list, drafts: list[list[int]]) -> bool:
        """Whether this decode batch should verify these drafts (a verify step is dearer than a
        decode step for every request in it, drafting or not)."""
        return True

    def on_verified(self, req, drafted: int, accepted: int) -> None:
        """A verify step accepted `accepted` of `drafted` tokens of `req`."""
        return None

    def on_finished(self, req) -> None:
        """`req` finished: let the drafter learn its last tokens."""
        return None

    def summary(self) -> dict:
        return {}

    def log_line(self) -> str:
        """Acceptance so far, for the scheduler's periodic log line ("" = nothing to say)."""
        return ""


def create_drafter(args, tokenizer, vocab_size: int, eos_token_ids) -> Drafter | None:
    algo = (args.speculative_algorithm or "").upper()
    if not algo:
        return None
    if algo == "NGRAM":
        from loom.runtime.spec.speculator import NgramSpeculator

        return NgramSpeculator(args, tokenizer, vocab_size, eos_token_ids)
    raise ValueError(f"speculative_algorithm: unknown algorithm {args.speculative_algorithm!r}")
