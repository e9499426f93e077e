"""Self-distilled EAGLE-3 training data at scale, through the serving path (issue 33).

`eagle_features.precompute` runs an eager f32 torch pass per document (~1 s a document on one
thread) and `train_eagle3_smollm2.py` wrote answers through Engine a batch at a time; both
fine for 48k tokens, a day of the machine for millions. Here everything runs on in-process
Schedulers, the C forward, one thread:

- `Distiller.generate`: the data model writes prompts (sampled, a seed per request) and
  answers them greedily, a whole batch (`batch` requests) in flight at once.
- `Distiller.features`: one prefill of prompt + answer on the feature model (radix cache off,
  one chunk) with `ModelInput.capture` set to the head's layers: `ForwardOutput.hidden` is
  the C forward's capture, the same features serving feeds the head, and the prompt
  logprobs' top-1 (logprob_start_len 0) is the target's greedy next token at every position,
  so training needs no target pass per step. `check_against_eager` compares both with
  `eagle_unroll.target_pass` (the eager pass training used before).

Shards (`write_shard`) hold what `eagle_features.train` reads (ids int32, answer start,
feats [T, 3H] bf16, argmax [T] int32, capture) plus the prompt texts; they are written whole
(a temporary file renamed), so an interrupted run loses at most the batch in flight and a
rerun appends after the last shard.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from loom.runtime.io_struct import TokenizedGenerateReq
from loom.runtime.sampling_params import make_sampling_params


def _scheduler(model: str, threads: int, batch: int, capture: bool, max_total_tokens: int):
    from loom.runtime.scheduler.scheduler import Scheduler
    from loom.runtime.server_args import ServerArgs

    kw = {"dtype": "float32", "cpu_threads": threads, "max_running_requests": batch,
          "max_total_tokens": max_total_tokens}  # fmt: skip
    if capture:  # every position of prompt + answer in one prefill: no radix hit, no chunks
        kw.update(disable_radix_cache=True, chunked_prefill_size=8192)
    return Scheduler(ServerArgs(model_path=os.path.expanduser(model), **kw))


def run_all(sched, reqs: list[TokenizedGenerateReq]) -> dict[str, dict]:
    """Run `reqs` to completion on `sched`: rid -> {"ids": output ids, "top": prompt top-1
    lists (when asked)}."""
    got = {r.rid: {"ids": [], "top": None} for r in reqs}
    for r in reqs:
        sched.add_request(r)
    while not sched.is_idle:
        for o in sched.step():
            g = got[o.rid]
            g["ids"] = g["ids"][: len(g["ids"]) - o.rewind] + list(o.new_ids)
            if o.input_top_logprobs:
                g["top"] = (g["top"] or []) + list(o.input_top_logprobs)
    return got


class Distiller:
    """`data_model` writes prompts and greedy answers; `feature_model` (the target the head
    serves) gives features and labels. Both in-process, `threads` C-forward threads."""

    def __init__(self, data_model: str, feature_model: str, capture: tuple[int, ...],
                 batch: int = 64, threads: int = 1, max_len: int = 1024):  # fmt: skip
        self.capture = tuple(capture)
        self.batch = batch
        self.gen = _scheduler(data_model, threads, batch, False, batch * max_len)
        # its own scheduler even for the same model: radix off, one chunk, capture on
        self.feat = _scheduler(feature_model, threads, 4, True, 4 * max_len)
        self._grabbed: list = []
        forward = self.feat.runner.forward

        def capturing(inp):  # the one seam serving uses (`Scheduler.step`'s inp.capture)
            inp.capture = self.capture
            out = forward(inp)
            self._grabbed.append((len(inp.input_ids), out.hidden))
            return out

        self.feat.runner.forward = capturing

    def generate(self, prompts: list[list[int]], max_new: int, temperature: float = 0.0,
                 seeds: list[int] | None = None) -> list[list[int]]:  # fmt: skip
        """Output ids per prompt (greedy unless `temperature`), all in flight at once."""
        reqs = [
            TokenizedGenerateReq(
                rid=f"g{i}", input_ids=p, seed=(seeds[i] if seeds else 0),
                sampling_params=make_sampling_params(
                    {"temperature": temperature, "max_new_tokens": max_new}),
            )
            for i, p in enumerate(prompts)
        ]  # fmt: skip
        got = run_all(self.gen, reqs)
        return [got[f"g{i}"]["ids"] for i in range(len(prompts))]

    def features(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(features [T, len(capture) * H] bf16, the target's greedy next token [T] int32) of
        the document `ids`, from one prefill."""
        self._grabbed.clear()
        req = TokenizedGenerateReq(
            rid="f", input_ids=list(ids), seed=0, return_logprob=True, logprob_start_len=0,
            top_logprobs_num=1,
            sampling_params=make_sampling_params({"temperature": 0, "max_new_tokens": 1}),
        )  # fmt: skip
        got = run_all(self.feat, [req])["f"]
        n, hidden = self._grabbed[0]
        if n != len(ids) or hidden is None:
            raise RuntimeError(f"the prefill fed {n} of {len(ids)} tokens / captured nothing")
        feats = torch.cat([h.float() for h in hidden[1]], -1)
        top = got["top"]  # entry j: the top-1 at position j - 1 (entry 0 has none)
        argmax = [t[0][1] for t in top[1:]] + [got["ids"][0]]
        return feats.to(torch.bfloat16), torch.tensor(argmax, dtype=torch.int32)


def check_against_eager(model, capture, ids: list[int], feats: torch.Tensor,
                        argmax: torch.Tensor) -> tuple[list[float], float]:  # fmt: skip
    """(relative error of each captured layer against `eagle_unroll.target_pass`'s f32
    features, position 0 aside: the attention sink's residual is ~10^4; share of positions
    whose greedy token agrees)."""
    from loom.runtime.spec.eagle_unroll import target_pass

    with torch.no_grad():
        logits, want = target_pass(model, torch.tensor([ids]), tuple(capture))
    want = want[0, 1:]
    got = feats[1:].float()
    h = want.shape[-1] // len(capture)
    errs = [float((got[:, k * h:(k + 1) * h] - want[:, k * h:(k + 1) * h]).norm()
                  / want[:, k * h:(k + 1) * h].norm()) for k in range(len(capture))]  # fmt: skip
    agree = float((logits[0].argmax(-1).to(torch.int32) == argmax).float().mean())
    return errs, agree


def write_shard(path: Path, rec: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(rec, tmp)
    tmp.replace(path)


def load_shards(paths: list[Path]) -> dict:
    """Concatenate shards into one `eagle_features` record dict (ids, start, feats, argmax,
    capture, prompts)."""
    out = {"ids": [], "start": [], "feats": [], "argmax": [], "capture": None, "prompts": []}
    for p in paths:
        r = torch.load(p, weights_only=False)
        if out["capture"] is None:
            out["capture"] = r["capture"]
        elif out["capture"] != r["capture"]:
            raise ValueError(f"{p} holds layers {r['capture']}, not {out['capture']}")
        for k in ("ids", "start", "feats", "argmax"):
            out[k] += r[k]
        out["prompts"] += r.get("prompts", [""] * len(r["ids"]))
    return out
