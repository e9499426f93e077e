"""A request's own n-grams: drafts that copy what this request's prompt and output did.

The trie (`ngram.NgramLookup`) holds every request's windows and follows, from the deepest
match anywhere, the continuation a model generated most recently (what a JSON answer needs:
the previous answer's shape). On free text that picks another request's words over this
request's own: a RAG or summary answer repeats its prompt's phrases, a math answer its own
numbers, and a deeper match in another answer wins over them. `OwnIndex` maps every window
of 1 .. `window` tokens of the request's own tokens (its prompt's tail and its output) to
where it last ended with a token after it; a draft follows the longest window of the
current suffix that occurred before (`NgramLookup.propose` with `own`: the trie only where
the request's own tokens have no match). Spec-Bench held-out rows, SmolLM2: docs/benchmarks.md,
"Issue 33: where NGRAM's drafts are lost on the f32 target".
"""

from __future__ import annotations

# the longest window of its own tokens a request matches: its dict holds this many keys a
# token (~1.3 MB at a 2,048-token prompt tail with 6; the held-out replay drafted as well
# with 6 as with 12)
OWN_WINDOW = 6


class OwnIndex:
    """The last end position of each window of the request's tokens seen so far that has a
    token after it (`ends`: window tuple -> index into `tokens`). Built incrementally: a token
    appended gives the windows ending just before it their continuation."""

    __slots__ = ("window", "tokens", "ends", "start")

    def __init__(self, window: int, start: int = 0):
        self.window = window
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], int] = {}
        self.start = start  # the request's token index of tokens[0] (a long prompt's tail)

    @property
    def seen(self) -> int:
        """The request's tokens this index has taken in (its sequence up to here)."""
        return self.start + len(self.tokens)

    def extend(self, tokens) -> None:
        seq, ends, w_max = self.tokens, self.ends, self.window
        for t in tokens:
            j = len(seq) - 1  # the windows ending at j now have a continuation
            for w in range(1, min(w_max, j + 1) + 1):
                ends[tuple(seq[j - w + 1 : j + 1])] = j
            seq.append(t)

    def propose(self, max_len: int, min_window: int = 1) -> list[int]:
        """Up to max_len tokens after the latest earlier occurrence of the longest suffix
        (at least min_window tokens) that occurred before; [] when none did."""
        seq, ends = self.tokens, self.ends
        n = len(seq)
        for w in range(min(self.window, n - 1), min_window - 1, -1):
            j = ends.get(tuple(seq[n - w :]))
            if j is not None:
                return seq[j + 1 : j + 1 + max_len]
        return []
