"""Concurrency shown, not assumed: one check, shared by the Engine and RuntimeEndpoint suites.

An 8-way fork on the bundled model must put its 8 generations in the same scheduler decode
batches (meta_info `first_decode_step` / `last_decode_step` / `decode_batch_max`), and every
branch must read the shared prefix from the radix cache (`cached_tokens`).
"""

from __future__ import annotations

import loom as sgl

PREFIX = "Paris is the capital of France. Berlin is the capital of Germany.\n" * 4
# Each branch is sent by its own thread: on a loaded machine the last one can reach the
# scheduler tens of ms after the first, which must still be decoding then (12 tokens, ~50 ms
# on the bundled model, left too little room), so each branch decodes 48.
BRANCH_TOKENS = 48


@sgl.function
def fork8(s):
    s += PREFIX
    forks = s.fork(8)
    forks += lambda i: f"Idea {i}:" + sgl.gen("idea", max_tokens=BRANCH_TOKENS, ignore_eos=True)
    forks.join()


def check_fork8_runs_batched(backend, tokenize) -> None:
    """`tokenize(texts) -> token id lists`, as the runtime tokenizes prompts."""
    prefix_ids, branch_ids = tokenize([PREFIX, PREFIX + "Idea 0:"])
    assert branch_ids[: len(prefix_ids)] == prefix_ids  # the fork point is a token boundary
    state = fork8.run(backend=backend, temperature=0.7)
    metas = state.get_meta_info("idea")
    assert len(metas) == 8
    for m in metas:
        assert m["completion_tokens"] == BRANCH_TOKENS
        # the first token is sampled by the prefill, the rest by decode steps
        assert m["last_decode_step"] - m["first_decode_step"] >= BRANCH_TOKENS - 2, m
        assert m["cached_tokens"] >= len(prefix_ids), m
    # intervals that pairwise overlap share a step: all 8 were decoding in it, together
    last_first = max(m["first_decode_step"] for m in metas)
    first_last = min(m["last_decode_step"] for m in metas)
    assert last_first <= first_last, [
        (m["first_decode_step"], m["last_decode_step"]) for m in metas
    ]
    assert all(m["decode_batch_max"] >= 8 for m in metas), [m["decode_batch_max"] for m in metas]
