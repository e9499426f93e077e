"""One sampling step's CPU cost: `SamplingInfo.from_reqs` plus the runner's sampling entry
point (`greedy_verify` for greedy rows, `sample_verify_trees` at temperature 0.7, top-p 0.9,
top-k 40), batch 16, a 49,152-token vocabulary, chain drafts of 4 tokens on half the requests,
one torch thread; process CPU time per step. Prints `greedy_ms X` and `sampled_ms Y`.

    python benchmarks/bench_sampler_step.py

Two builds side by side: `python benchmarks/ab_builds.py --old OLD --rounds 6 --figure
'greedy_ms=greedy_ms ([0-9.]+)' --figure 'sampled_ms=sampled_ms ([0-9.]+)' --
$PWD/benchmarks/bench_sampler_step.py` (an absolute path: the old checkout may not have it;
it uses only names both builds export from `loom.runtime.sampler`).
"""

import time

import torch

from loom.runtime import sampler
from loom.runtime.req import Req
from loom.runtime.sampling_params import make_sampling_params

torch.set_num_threads(1)
V, B, N = 49152, 16, 60
g = torch.Generator().manual_seed(0)
PARAMS = (
    ("greedy", {"temperature": 0.0}),
    ("sampled", {"temperature": 0.7, "top_p": 0.9, "top_k": 40}),
)
for label, params in PARAMS:
    reqs = [
        Req(f"r{i}", list(range(3, 40)), make_sampling_params({"max_new_tokens": 64, **params}), i)
        for i in range(B)
    ]
    drafts = [[5, 6, 7, 8] if i % 2 else [] for i in range(B)]
    rows = sum(1 + len(d) for d in drafts)
    logits = torch.randn(rows, V, generator=g)
    for _ in range(5):
        info = sampler.SamplingInfo.from_reqs(reqs, V, drafts=drafts)
        sampler.sample_verify_trees(logits.clone(), info)
    t = time.process_time()
    for _ in range(N):
        info = sampler.SamplingInfo.from_reqs(reqs, V, drafts=drafts)
        x = logits.clone()
        if label == "greedy":
            sampler.greedy_verify(x, info)
        else:
            sampler.sample_verify_trees(x, info)
    print(f"{label}_ms {(time.process_time() - t) / N * 1e3:.3f}")
