"""Acceptance statistics of speculative decoding: per draft position and per verify step."""

from __future__ import annotations


class AcceptanceStats:
    """`proposed[j]` / `accepted[j]`: draft tokens offered / accepted at position j (0 = the
    first draft token); `accept_len_hist[k]`: verify steps that accepted k draft tokens;
    `forced_*`: the grammar-forced part of the drafts, counted apart."""

    def __init__(self, num_positions: int):
        self.proposed = [0] * num_positions
        self.accepted = [0] * num_positions
        self.accept_len_hist = [0] * (num_positions + 1)
        self.verify_ct = 0
        self.forced_proposed = 0
        self.forced_accepted = 0
        self.skipped = 0  # request-steps without n-gram drafts (decode batch over the threshold)

    def record(self, drafted: int, accepted: int, forced: int) -> None:
        self.verify_ct += 1
        self.accept_len_hist[min(accepted, len(self.accept_len_hist) - 1)] += 1
        for j in range(min(drafted, len(self.proposed))):
            self.proposed[j] += 1
            self.accepted[j] += j < accepted
        self.forced_proposed += forced
        self.forced_accepted += min(forced, accepted)

    @property
    def mean_accept_length(self) -> float:
        """Tokens gained per verify step: accepted drafts + the one sampled token."""
        total = sum(k * n for k, n in enumerate(self.accept_len_hist))
        return 1 + total / max(1, self.verify_ct)

    def acceptance_by_position(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted, self.proposed)]

    def summary(self) -> dict:
        return {
            "spec_verify_ct": self.verify_ct,
            "spec_accept_length": round(self.mean_accept_length, 4),
            "spec_proposed_by_position": list(self.proposed),
            "spec_accepted_by_position": list(self.accepted),
            "spec_accept_len_hist": list(self.accept_len_hist),
            "spec_forced_proposed": self.forced_proposed,
            "spec_forced_accepted": self.forced_accepted,
            "spec_skipped": self.skipped,
        }

    def log_line(self) -> str:
        rates = " ".join(f"{r:.2f}" for r in self.acceptance_by_position())
        return (
            f"spec: {self.verify_ct} verifies, {self.mean_accept_length:.2f} tokens/verify, "
            f"acceptance by position [{rates}], accept-length histogram {self.accept_len_hist}"
        )
