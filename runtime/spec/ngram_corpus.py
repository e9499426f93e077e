"""A read-only datastore of text written on other prompts, as a source of n-gram drafts.

REST (He et al. 2023) and SuffixDecoding (Oliaro et al. 2024) draft from a store of earlier
text: here the model's own greedy answers to prompts it wrote itself
(`scripts/ngram_corpus.py`), kept beside the live trie and never written to. `CorpusIndex`
maps every window of 1 .. `window` tokens of each document (windows never cross a
document's end) to the token that most often followed it (count, and how many times the
window had any continuation). A draft is a greedy walk: the longest window of the current
suffix (the request's tokens, then the tokens drafted so far) the store knows, its most
frequent next token, while that token's share among the window's continuations stays at
least `min_share`. That is a back-off n-gram model's greedy decode over the store.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

CORPUS_WINDOW = 8  # the longest window a draft matches


class CorpusIndex:
    """Windows of the documents -> (most frequent next token, its count, the window's count)."""

    __slots__ = ("window", "table", "tokens", "docs")

    def __init__(self, docs: Iterable[Sequence[int]], window: int = CORPUS_WINDOW):
        self.window = window
        counts: Counter = Counter()
        self.tokens = self.docs = 0
        for doc in docs:
            doc = tuple(doc)
            self.docs += 1
            self.tokens += len(doc)
            for i in range(1, len(doc)):
                for w in range(1, min(window, i) + 1):
                    counts[doc[i - w : i + 1]] += 1  # the window, then its next token
        table: dict[tuple[int, ...], list[int]] = {}
        for key, n in counts.items():
            ctx = key[:-1]
            e = table.get(ctx)
            if e is None:
                table[ctx] = [key[-1], n, n]
            else:
                e[2] += n
                if n > e[1] or (n == e[1] and key[-1] < e[0]):  # ties: the smaller id
                    e[0], e[1] = key[-1], n
        self.table = {k: tuple(v) for k, v in table.items()}

    def __len__(self) -> int:
        return len(self.table)

    def match(self, context: Sequence[int], min_window: int = 1) -> tuple[int, tuple] | None:
        """(window length, (token, count, total)) of the longest suffix of `context` the store
        knows, at least min_window tokens; None when none."""
        n = len(context)
        table = self.table
        for w in range(min(self.window, n), min_window - 1, -1):
            e = table.get(tuple(context[n - w :]))
            if e is not None:
                return w, e
        return None

    def propose(
        self, context: Sequence[int], max_len: int, min_window: int = 1, min_share: float = 0.0
    ) -> list[int]:
        """Up to max_len tokens the store predicts after `context` (its last `window` tokens
        are read): [] when no suffix of at least min_window tokens occurs in it."""
        ctx = list(context[-self.window :])
        draft: list[int] = []
        while len(draft) < max_len:
            m = self.match(ctx, min_window)
            if m is None:
                break
            token, count, total = m[1]
            if count < min_share * total:
                break
            draft.append(token)
            ctx.append(token)
            if len(ctx) > self.window:
                del ctx[0]
        return draft
