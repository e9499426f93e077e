"""Sampling: prepared on the CPU once per step, applied on the device with no host sync.

Randomness is counter-based: the noise for request r at sequence position p over token t is a
hash of (seed_r, p, t). A request's samples therefore depend only on its own seed and
position, never on what else is in the batch, and resume identically after a retraction.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from loom.runtime.req import Req

_M1 = 0x9E3779B97F4A7C15 - (1 << 64)
_M2 = 0xBF58476D1CE4E5B9 - (1 << 64)
_M3 = 0x94D049BB133111EB - (1 << 64)
_LOW31 = (1 << 31) - 1


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def hashed_uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V] uniforms in (0, 1) from splitmix64 over (seed, step, token)."""
    token = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    x = seeds[:, None] * _M1 + steps[:, None] * _M3 + token[None, :] * _M2
    x = (x ^ _srl(x, 30)) * _M2
    x = (x ^ _srl(x, 27)) * _M3
    x = x ^ _srl(x, 31)
    mantissa = _srl(x, 11).to(torch.float64)
    return ((mantissa + 0.5) / float(1 << 53)).to(torch.float32).clamp_(1e-20, 1.0 - 1e-7)


@dataclass
class SamplingInfo:
    """One row per sampling request, built on the CPU by the scheduler (`from_reqs`); the
    runner moves it to its device (`to`) and, for draft verification, repeats each row once
    per position it samples (`expand`)."""

    temperatures: torch.Tensor  # [B, 1]
    top_ps: torch.Tensor
    top_ks: torch.Tensor
    min_ps: torch.Tensor
    greedy: torch.Tensor  # [B] bool
    seeds: torch.Tensor
    steps: torch.Tensor  # [B] sequence position of the token sampled (the noise counter)
    need_top_filter: bool
    need_min_p: bool
    all_greedy: bool
    logit_bias: torch.Tensor | None  # [B, V]
    penalty: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) masked to -inf
    vocab_mask: torch.Tensor | None = None  # grammar bitmask [B, words]

    @classmethod
    def from_reqs(cls, reqs: list[Req], vocab_size: int, device: str = "cpu") -> SamplingInfo:
        ps = [r.sampling_params for r in reqs]
        greedy = [p.is_greedy for p in ps]
        temps = [1.0 if g else p.temperature for p, g in zip(ps, greedy)]
        top_ks = [vocab_size if p.top_k < 0 else min(p.top_k, vocab_size) for p in ps]
        dev = torch.device(device)
        f32 = dict(dtype=torch.float32, device=dev)
        i64 = dict(dtype=torch.int64, device=dev)
        logit_bias = None
        if any(p.logit_bias for p in ps):
            logit_bias = torch.zeros(len(reqs), vocab_size, **f32)
            for i, p in enumerate(ps):
                for tok, bias in (p.logit_bias or {}).items():
                    logit_bias[i, tok] = bias
        banned_rows, banned_ids = [], []
        for i, r in enumerate(reqs):
            if len(r.output_ids) < r.sampling_params.min_new_tokens:
                stops = set(r.sampling_params.stop_token_ids or ()) | set(r.eos_token_ids)
                for t in stops:
                    if t < vocab_size:
                        banned_rows.append(i)
                        banned_ids.append(t)
        banned = None
        if banned_rows:
            banned = (torch.tensor(banned_rows, **i64), torch.tensor(banned_ids, **i64))
        return cls(
            temperatures=torch.tensor(temps, **f32)[:, None],
            top_ps=torch.tensor([p.top_p for p in ps], **f32),
            top_ks=torch.tensor(top_ks, **i64),
            min_ps=torch.tensor([p.min_p for p in ps], **f32),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=dev),
            seeds=torch.tensor([r.seed for r in reqs], **i64),
            steps=torch.tensor([r.seq_len for r in reqs], **i64),
            need_top_filter=any(p.top_p < 1.0 or p.top_k > 0 for p in ps),
            need_min_p=any(p.min_p > 0 for p in ps),
            all_greedy=all(greedy),
            logit_bias=logit_bias,
            penalty=_penalty_tensors(reqs, vocab_size, dev),
            banned=banned,
        )

    def to(self, device: torch.device | str) -> SamplingInfo:
        def move(x):
            if isinstance(x, torch.Tensor):
                return x.to(device, non_blocking=True)
            if isinstance(x, tuple):
                return tuple(move(t) for t in x)
            return x

        return SamplingInfo(**{f.name: move(getattr(self, f.name)) for f in fields(self)})

    def expand(self, counts: list[int]) -> SamplingInfo:
        """Row i repeated counts[i] times, its noise counter advancing by one per copy (the
        copy j samples the token at position steps[i] + j)."""
        if all(c == 1 for c in counts):
            return self
        if self.penalty is not None or self.banned is not None or self.vocab_mask is not None:
            raise ValueError(
                "draft verification: penalties, min_new_tokens and grammars change per position"
            )
        dev = self.seeds.device
        reps = torch.tensor(counts, device=dev)
        src = torch.repeat_interleave(torch.arange(len(counts), device=dev), reps)
        first = torch.cumsum(reps, 0) - reps
        offset = torch.arange(len(src), device=dev) - torch.repeat_interleave(first, reps)
        out = replace(
            self,
            **{
                name: getattr(self, name).index_select(0, src)
                for name in ("temperatures", "top_ps", "top_ks", "min_ps", "greedy", "seeds")
            },
        )
        out.steps = self.steps.index_select(0, src) + offset
        if self.logit_bias is not None:
            out.logit_bias = self.logit_bias.index_select(0, src)
        return out


def _penalty_tensors(reqs: list[Req], vocab_size: int, dev):
    ps = [r.sampling_params for r in reqs]
    if all(
        p.frequency_penalty == 0 and p.presence_penalty == 0 and p.repetition_penalty == 1
        for p in ps
    ):
        return None
    b = len(reqs)
    out_counts = torch.zeros(b, vocab_size, dtype=torch.float32)
    seen = torch.zeros(b, vocab_size, dtype=torch.bool)
    for i, r in enumerate(reqs):
        if r.output_ids:
            out_counts[i].index_add_(0, torch.tensor(r.output_ids), torch.ones(len(r.output_ids)))
        if ps[i].repetition_penalty != 1:
            seen[i, torch.tensor(r.fill_ids)] = True
    freq = torch.tensor([p.frequency_penalty for p in ps])[:, None]
    pres = torch.tensor([p.presence_penalty for p in ps])[:, None]
    rep = torch.tensor([p.repetition_penalty for p in ps])[:, None]
    return tuple(t.to(dev) for t in (out_counts, seen, freq, pres, rep))


def apply_penalties(logits: torch.Tensor, info: SamplingInfo) -> None:
    if info.logit_bias is not None:
        logits += info.logit_bias
    if info.penalty is not None:
        counts, seen, freq, pres, rep = info.penalty
        # repetition (over prompt and output): shrink positive logits, grow negative ones
        scaled = torch.where(logits > 0, logits / rep, logits * rep)
        logits.copy_(torch.where(seen, scaled, logits))
        logits -= freq * counts + pres * (counts > 0).float()
    if info.banned is not None:
        logits[info.banned] = float("-inf")
    if info.vocab_mask is not None:
        from loom.grammar.base import apply_token_bitmask_

        apply_token_bitmask_(logits, info.vocab_mask)


def sample(logits: torch.Tensor, info: SamplingInfo) -> torch.Tensor:
    """logits [B, V] float32 (modified in place) -> next token ids [B]."""
    apply_penalties(logits, info)
    greedy_ids = logits.argmax(dim=-1)
    if info.all_greedy:
        return greedy_ids
    probs = torch.softmax(logits / info.temperatures, dim=-1)
    if info.need_top_filter or info.need_min_p:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        ranks = torch.arange(probs.shape[-1], device=probs.device)[None, :]
        drop = (sorted_probs.cumsum(-1) - sorted_probs) > info.top_ps[:, None]
        drop |= ranks >= info.top_ks[:, None]
        if info.need_min_p:
            drop |= sorted_probs < sorted_probs[:, :1] * info.min_ps[:, None]
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
    noise = hashed_uniform(info.seeds, info.steps, probs.shape[-1])
    sampled = (probs / -torch.log(noise)).argmax(dim=-1)  # exponential race = categorical sample
    return torch.where(info.greedy, greedy_ids, sampled)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, top_num: int):
    """Raw-model logprobs of `token_ids` and the top-`top_num` entries per row: one
    log_softmax over all the rows given (the caller gathers every row that needs one)."""
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(1, token_ids[:, None]).squeeze(1)
    if top_num > 0:
        top_vals, top_ids = logp.topk(min(top_num, logp.shape[-1]), dim=-1)
        return chosen, top_vals, top_ids
    return chosen, None, None
