"""Sampling by job: `info` (the per-row state a step samples with, built on the CPU), `params`
(its per-row parameter tensors, reused across steps), `rng` (counter-based noise),
`penalties` (bias, penalties, bans and the grammar mask on the logits), `verify` (target
distribution, draft acceptance and tree walks), `logprobs`. Mask rows arrive as tensors
(`runtime/step_grammar.py` fills them from grammar objects); `runtime/sampler.py` composes
the jobs into a step's sampling."""
