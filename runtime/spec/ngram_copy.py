"""Prompt copies for the n-gram drafter: the words an answer copies from its own prompt.

An extraction answer's values are words of its prompt (`Alice is 31 and lives in Paris.` ->
`{"name": "Alice", "age": 31, "city": "Paris"}`), different in every request and tokenized
apart (` Paris` in the prompt, `Paris` after the opening quote), so the trie, which drafts
what followed the same context before, drafts the previous request's value there and the
verify stops at it. This learns, from finished requests, per answer context (its last CONTEXT
tokens: `city": "`), the prompt token that the copied word followed (its anchor: ` in` before
` Paris`) and whether the answer dropped the word's leading space; a draft at that context
then proposes the word after the anchor in its own prompt, spelt the same way
(`NgramLookup.propose`, which continues after the word as the trie continued after another
value there). An anchor keeps a score: 1 when learnt, +1 each time a finished answer wrote
the word it names at its context, -1 each time it wrote another; it drafts from MIN_SCORE
(confirmed at least once more than refuted), so free text, whose words rarely follow one
prompt token, keeps the trie's drafts.
"""

from __future__ import annotations

from collections.abc import Sequence

CONTEXT = 3  # answer tokens that key an anchor (`":`, ` "` alone do not tell name from city)
MAX_ANCHORS = 1 << 16  # contexts remembered (cleared when full, like the forced-text cache)
MAX_WORD_TOKENS = 4  # tokens of one copied word: its first and the pieces that continue it
MIN_SCORE = 2


class PromptCopy:
    """`anchors[context] = [anchor token, score, bare]`; `draft(prompt, index, context)` the
    word to copy there, `learn(prompt, output)` after a request finished."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.anchors: dict[tuple[int, ...], list[int]] = {}
        self._info: dict[int, tuple[int, bool, bool]] = {}
        self._vocab: dict[str, int] | None = None

    def token(self, t: int) -> tuple[int, bool, bool]:
        """(the token's id without its leading space, t itself when it has none or that
        spelling is not in the vocabulary; whether it is a word: letters or digits only;
        whether it starts with a space)."""
        info = self._info.get(t)
        if info is None:
            raw = self.tokenizer.convert_ids_to_tokens(t) or ""
            spaced = raw[:1] in ("Ġ", "▁")  # byte-level BPE / sentencepiece word starts
            word = self.tokenizer.decode([t]).strip().isalnum()
            bare = t
            if spaced and word:
                if self._vocab is None:
                    self._vocab = self.tokenizer.get_vocab()
                bare = self._vocab.get(raw[1:], t)
            info = self._info[t] = (bare, word, spaced)
        return info

    def is_piece(self, t: int) -> bool:
        """A word's continuation: letters or digits with no leading space (`1` of `31`)."""
        _, word, spaced = self.token(t)
        return word and not spaced

    @staticmethod
    def index(prompt: Sequence[int], start: int = 0) -> dict[int, int]:
        """Each prompt token's last position from `start` on that has a token after it."""
        return {t: j for j, t in enumerate(prompt[start:-1], start)}

    def word(
        self, prompt: Sequence[int], index: dict[int, int], anchor: int, bare: bool
    ) -> list[int]:
        """The word after the anchor's last occurrence in the prompt (its first token without
        its leading space if `bare`), or []."""
        j = index.get(anchor)
        if j is None:
            return []
        first = prompt[j + 1]
        spelt, word, spaced = self.token(first)
        if not word or (bare and spaced and spelt == first):
            return []  # no word, or no spelling of it without its space
        out = [spelt if bare else first]
        for t in prompt[j + 2 : j + 1 + MAX_WORD_TOKENS]:
            if not self.is_piece(t):
                break
            out.append(t)
        return out

    def draft(self, prompt: Sequence[int], index: dict[int, int], context: tuple) -> list[int]:
        entry = self.anchors.get(context)
        if entry is None or entry[1] < MIN_SCORE:
            return []
        return self.word(prompt, index, entry[0], entry[2])

    def learn(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Score the anchors at every context of the answer, and anchor each answer word
        found in the prompt (as spelt there or without its space) where no anchor, or a losing
        one, was."""
        if not output or len(prompt) < 2:
            return
        index = self.index(prompt)
        # a prompt word's token, and its spelling without its space -> (the token before it,
        # whether the answer's spelling is that bare one)
        before: dict[int, tuple[int, bool]] = {}
        for j in range(1, len(prompt)):
            t = prompt[j]
            spelt, word, _ = self.token(t)
            if word:
                if spelt != t:
                    before[spelt] = (prompt[j - 1], True)
                before[t] = (prompt[j - 1], False)
        seq = list(prompt[-CONTEXT:]) + list(output)
        anchors = self.anchors
        for i in range(CONTEXT, len(seq)):
            t = seq[i]
            key = tuple(seq[i - CONTEXT : i])
            entry = anchors.get(key)
            if entry is not None:
                named = self.word(prompt, index, entry[0], entry[2])
                if named:
                    entry[1] += 1 if named[0] == t else -1
            found = before.get(t)
            if found is None:
                continue
            if entry is None:
                if len(anchors) >= MAX_ANCHORS:
                    anchors.clear()
                anchors[key] = [found[0], 1, found[1]]
            elif entry[1] <= 0:
                entry[:] = [found[0], 1, found[1]]
