"""How `select` turns per-choice token log-probabilities into a decision (SGLang's semantics).

Each method receives, per choice, the triples `[logprob, token_id, text]` of the choice's own
tokens (after the prefix shared by all choices), and returns a `ChoicesDecision`.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import Any


@dataclasses.dataclass
class ChoicesDecision:
    decision: str
    meta_info: dict[str, Any] | None = None


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=lambda i: values[i])  # first of equals wins


class ChoicesSamplingMethod(ABC):
    @property
    def requires_unconditional_logprobs(self) -> bool:
        return False

    @abstractmethod
    def __call__(
        self,
        *,
        choices: list[str],
        normalized_prompt_logprobs: list[float],
        input_token_logprobs: list[list[Any]],
        output_token_logprobs: list[list[Any]],
        unconditional_token_logprobs: list[list[Any]] | None = None,
    ) -> ChoicesDecision: ...


class TokenLengthNormalized(ChoicesSamplingMethod):
    """The choice with the highest mean token log-probability."""

    def __call__(
        self,
        *,
        choices,
        normalized_prompt_logprobs,
        input_token_logprobs,
        output_token_logprobs,
        unconditional_token_logprobs=None,
    ):
        best = choices[_argmax(normalized_prompt_logprobs)]
        meta = {
            "normalized_prompt_logprobs": normalized_prompt_logprobs,
            "input_token_logprobs": input_token_logprobs,
            "output_token_logprobs": output_token_logprobs,
        }
        return ChoicesDecision(best, meta)


class GreedyTokenSelection(ChoicesSamplingMethod):
    """Compare choices token by token, keeping those with the best log-probability at each
    position. A shorter choice is padded with its own mean log-probability."""

    def __call__(
        self,
        *,
        choices,
        normalized_prompt_logprobs,
        input_token_logprobs,
        output_token_logprobs,
        unconditional_token_logprobs=None,
    ):
        width = max(len(option) for option in input_token_logprobs)
        matrix = []
        for option in input_token_logprobs:
            row = [t[0] for t in option]
            matrix.append(row + [_mean(row)] * (width - len(row)))
        remaining = list(range(len(choices)))
        for j in range(width):
            best = max(matrix[i][j] for i in remaining)
            remaining = [i for i in remaining if matrix[i][j] == best]
            if len(remaining) == 1:
                break
        meta = {
            "normalized_prompt_logprobs": normalized_prompt_logprobs,
            "input_token_logprobs": input_token_logprobs,
            "output_token_logprobs": output_token_logprobs,
            "greedy_logprob_matrix": matrix,
        }
        return ChoicesDecision(choices[remaining[0]], meta)


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    """The choice with the highest mean of (conditional - unconditional) token log-probability;
    a missing first unconditional log-probability counts as 0."""

    @property
    def requires_unconditional_logprobs(self) -> bool:
        return True

    def __call__(
        self,
        *,
        choices,
        normalized_prompt_logprobs,
        input_token_logprobs,
        output_token_logprobs,
        unconditional_token_logprobs=None,
    ):
        if unconditional_token_logprobs is None:
            raise ValueError("Unconditional token logprobs are required for this method.")
        scores = []
        for inputs, uncond in zip(input_token_logprobs, unconditional_token_logprobs):
            base = [t[0] for t in uncond]
            if base:
                base[0] = base[0] or 0.0
            scores.append(_mean([t[0] - u for t, u in zip(inputs, base)]))
        meta = {
            "normalized_prompt_logprobs": normalized_prompt_logprobs,
            "input_token_logprobs": input_token_logprobs,
            "output_token_logprobs": output_token_logprobs,
            "unconditional_token_logprobs": unconditional_token_logprobs,
            "normalized_unconditional_prompt_logprobs": scores,
        }
        return ChoicesDecision(choices[_argmax(scores)], meta)


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
