"""`create_drafter`: the drafter `--speculative-algorithm` names, imported lazily (nothing of a
drafter loads unless speculation is on)."""

from __future__ import annotations

from loom.runtime.spec import Drafter


def create_drafter(
    args, tokenizer, vocab_size: int, eos_token_ids, runner=None, grammar=None
) -> Drafter | None:
    """`runner`: the ModelRunner (model-based drafters run their head beside the target; the
    n-gram drafter needs none). `grammar`: the scheduler's `step_grammar.StepGrammar` (forced
    text and draft walks; None: the drafter makes its own)."""
    algo = (args.speculative_algorithm or "").upper()
    if not algo:
        return None
    if algo == "NGRAM":
        from loom.runtime.spec.speculator import NgramSpeculator

        return NgramSpeculator(args, tokenizer, vocab_size, eos_token_ids, grammar=grammar)
    if algo == "MEDUSA":
        from loom.runtime.spec.medusa_drafter import MedusaSpeculator

        return MedusaSpeculator(args, tokenizer=tokenizer, runner=runner, vocab_size=vocab_size,
                                eos_token_ids=eos_token_ids, grammar=grammar)  # fmt: skip
    if algo in ("EAGLE", "EAGLE3"):
        from loom.runtime.spec.eagle_drafter import EagleSpeculator

        return EagleSpeculator(args, runner, tokenizer, vocab_size, eos_token_ids, grammar=grammar)
    raise ValueError(f"speculative_algorithm: unknown algorithm {args.speculative_algorithm!r}")
