"""runtime/array_runner.py, the torch-free runner of a GGUF model in the C forward, against the
torch `ModelRunner` + `CpuForward` on the real GGUF files: the same pool and table sizes, the
same logits bit for bit through the real scheduler (once torch's rotary tables are copied into
the numpy ones: numpy's float32 pow / cos / sin differ from torch's in the last bit, see
tests/test_cpu_model.py), the same tokens; which flags choose it; a scheduler process that
never imports torch, and an Engine whose scheduler and detokenizer processes never map it."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from loom.runtime import array_runner, cpu_abi, model_runner, runner_choice
from loom.runtime.server_args import ServerArgs
from tests.runtime_helpers import run_child

pytestmark = pytest.mark.skipif(cpu_abi.load() is None, reason="no C compiler")

PROMPTS = [[1, 504, 3458, 282, 4649, 314, 2, 198, 47, 30, 11, 99], [1, 1205, 42, 7], [1, 504, 17]]


def _requests(sched):
    from tests.runtime_helpers import submit

    greedy = {"temperature": 0, "ignore_eos": True}
    submit(sched, "g0", PROMPTS[0], {"max_new_tokens": 7, **greedy})
    submit(sched, "g1", PROMPTS[1], {"max_new_tokens": 5, **greedy})
    sampled = {"max_new_tokens": 6, "temperature": 0.8, "top_p": 0.9, "ignore_eos": True}
    submit(sched, "s2", PROMPTS[2], sampled, seed=5)
    # logprobs: sampling/logprobs.py's numpy path on the torch-free runner
    submit(sched, "l3", PROMPTS[1], {"max_new_tokens": 3, **greedy}, return_logprob=True,
           top_logprobs_num=2)  # fmt: skip


def _capture(monkeypatch, module, seen: list):
    real = module.sample_step

    def spy(inp, logits, n_sample, lp_targets):
        seen.append(logits.copy() if isinstance(logits, np.ndarray) else logits.numpy().copy())
        return real(inp, logits, n_sample, lp_targets)

    monkeypatch.setattr(module, "sample_step", spy)


def test_default_pool_sizes_equal_the_torch_runners(real_gguf):
    """Without --max-total-tokens both runners size the pool from the same host budget
    (kv_pages.pool_tokens): the same tokens, request rows and slots."""
    args = ServerArgs(model_path=real_gguf("smollm2"))
    torch_runner, runner = model_runner.ModelRunner(args), array_runner.ArrayRunner(args)
    for attr in ("max_total_tokens", "max_running_requests", "context_len"):
        assert getattr(runner, attr) == getattr(torch_runner, attr), attr
    assert runner.allocator.size == torch_runner.allocator.size


@pytest.mark.parametrize("name", ["smollm2", "gemma3-270m"])
def test_logits_and_tokens_equal_the_torch_runner(real_gguf, monkeypatch, name):
    from loom.runtime.scheduler.scheduler import Scheduler
    from tests.runtime_helpers import run_all

    args = ServerArgs(model_path=real_gguf(name), max_total_tokens=1024, page_size=4)
    assert runner_choice.why_not(args) is None
    torch_runner = model_runner.ModelRunner(args)
    assert torch_runner.cpu_forward is not None
    runner = array_runner.ArrayRunner(args)
    # what the scheduler reads: the same sizes, slots and rows
    assert runner.kv_dtype == "bf16" and str(torch_runner.kv_dtype) == "torch.bfloat16"
    for attr in ("max_total_tokens", "max_running_requests", "context_len", "vocab_size"):
        assert getattr(runner, attr) == getattr(torch_runner, attr), attr
    assert runner.allocator.size == torch_runner.allocator.size
    assert runner.req_to_token_pool.req_to_token.shape == tuple(
        torch_runner.req_to_token_pool.req_to_token.shape
    )
    assert isinstance(runner.req_to_token_pool.req_to_token, np.ndarray)
    fwd = runner.forward_impl
    for i, lay in enumerate(torch_runner.model.model.layers):
        key = fwd.cfg.local_rope if fwd.cfg.gemma and fwd.cfg.sliding[i] else fwd.cfg.global_rope
        rot = lay.self_attn.rotary_emb
        for mine, theirs in zip(fwd._tables[key], (rot.cos_cache, rot.sin_cache)):
            assert mine.shape == tuple(theirs.shape)
            np.testing.assert_allclose(mine, theirs.numpy(), rtol=0, atol=1e-4)
            mine[:] = theirs.numpy()
    runner.threads = torch.get_num_threads()  # CpuForward's count in this process
    outs, logits = [], []
    for r, module in ((torch_runner, model_runner), (runner, array_runner)):
        seen: list = []
        _capture(monkeypatch, module, seen)
        sched = Scheduler(args, model_runner=r)
        sched.check_integrity_every_step = True
        _requests(sched)
        res = run_all(sched)
        outs.append({k: (v.ids, v.output_logprobs, v.output_top) for k, v in res.items()})
        logits.append(seen)
    assert len(logits[0]) == len(logits[1]) > 5
    for ref, got in zip(*logits):
        assert ref.shape == got.shape and np.array_equal(ref, got)
    assert {k: v[0] for k, v in outs[0].items()} == {k: v[0] for k, v in outs[1].items()}
    # logprobs: the same logits through numpy's log_softmax (sampling/logprobs.py) against
    # torch's: exp / log differ in the last bits; the top ids are the same
    for (_, lps, tops), (_, lps1, tops1) in zip(outs[0].values(), outs[1].values()):
        assert len(lps) == len(lps1) and len(tops) == len(tops1)
        for a, b in zip(lps, lps1):
            assert a[1] == b[1] and abs(a[0] - b[0]) < 1e-4, (a, b)
        for a, b in zip(tops, tops1):
            assert [t[1] for t in a] == [t[1] for t in b]
            np.testing.assert_allclose([t[0] for t in a], [t[0] for t in b], atol=1e-4)


def test_a_constrained_request_gives_the_torch_runners_tokens(real_gguf, monkeypatch):
    """Grammar rows (the numpy bitmask, lazy greedy rows and a sampled row) on ArrayRunner's
    numpy logits: the torch runner's tokens."""
    from tests.runtime_helpers import make_scheduler, run_all, submit

    path = real_gguf("smollm2")
    outs = []
    for torch_runner in (False, True):
        if torch_runner:
            monkeypatch.setenv("LOOM_TORCH_RUNNER", "1")
        sched = make_scheduler(path, max_total_tokens=1024)
        assert type(sched.runner).__name__ == ("ModelRunner" if torch_runner else "ArrayRunner")
        regex = {"regex": r"(yes|no), [a-z]{2,6}\."}
        submit(sched, "greedy", PROMPTS[0], {"max_new_tokens": 12, "temperature": 0, **regex})
        submit(sched, "sampled", PROMPTS[1], {"max_new_tokens": 12, "temperature": 0.7, **regex},
               seed=3)  # fmt: skip
        outs.append({k: v.ids for k, v in run_all(sched).items()})
        sched.close()
    assert outs[0] == outs[1]


def test_a_step_past_the_c_forward_size_runs_in_parts(real_gguf, monkeypatch):
    """A prefill longer than cpu_model.MAX_TOKENS runs as consecutive parts: the same argmax,
    logits within the matmul mode's rounding (quant.c picks its kernel by row count)."""
    from loom.runtime import cpu_model
    from loom.runtime.scheduler.scheduler import Scheduler

    args = ServerArgs(model_path=real_gguf("smollm2"), max_total_tokens=512)
    got = {}
    for parts in (False, True):
        if parts:
            monkeypatch.setattr(cpu_model, "MAX_TOKENS", 5)
        seen: list = []
        _capture(monkeypatch, array_runner, seen)
        sched = Scheduler(args, model_runner=array_runner.ArrayRunner(args))
        from tests.runtime_helpers import run_all, submit

        submit(sched, "a", PROMPTS[0], {"max_new_tokens": 1, "temperature": 0})
        submit(sched, "b", PROMPTS[1], {"max_new_tokens": 1, "temperature": 0})
        run_all(sched)
        got[parts] = seen[0]
    assert np.array_equal(got[False].argmax(-1), got[True].argmax(-1))
    np.testing.assert_allclose(got[False], got[True], rtol=1e-3, atol=5e-2)


def test_which_flags_choose_it(real_gguf, tiny_model_dir):
    path = real_gguf("smollm2")
    assert runner_choice.why_not(ServerArgs(model_path=path)) is None
    assert runner_choice.why_not(ServerArgs(model_path=path, kv_cache_dtype="float32")) is None
    for kwargs, reason in (
        ({"speculative_algorithm": "ngram"}, "speculative"),
        ({"cpu_forward": "eager"}, "cpu-forward"),
        ({"attention_backend": "torch"}, "attention"),
        ({"dtype": "bfloat16"}, "dtype"),
        ({"enable_hierarchical_cache": True}, "hierarchical"),
    ):
        why = runner_choice.why_not(ServerArgs(model_path=path, **kwargs))
        assert why is not None and reason in why, (kwargs, why)
    assert "GGUF" in runner_choice.why_not(ServerArgs(model_path=tiny_model_dir("llama")))


_NO_TORCH = r"""
import sys

from loom.runtime.server_args import ServerArgs
from loom.runtime.scheduler.scheduler import Scheduler
from tests.runtime_helpers import run_all, submit

sched = Scheduler(ServerArgs(model_path=sys.argv[1], max_total_tokens=1024))
assert type(sched.runner).__name__ == "ArrayRunner"
greedy = {"temperature": 0, "ignore_eos": True}
submit(sched, "g0", [1, 504, 3458, 282, 4649, 314, 2], {"max_new_tokens": 6, **greedy})
submit(sched, "g1", [1, 1205, 42, 7], {"max_new_tokens": 4, **greedy})
out = run_all(sched)
print({k: v.ids for k, v in sorted(out.items())})
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")) [:1])
"""


def _scheduler_in_a_subprocess(path: str) -> tuple[dict, bool]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    lines = run_child(_NO_TORCH, path, timeout=600, cwd=root)
    return eval(lines[-2]), eval(lines[-1]) != []


def test_the_scheduler_in_its_own_process_gives_the_torch_runners_tokens(real_gguf, monkeypatch):
    """The Scheduler the scheduler process builds (ArrayRunner), in a fresh process, against the
    torch runner's Scheduler here."""
    from loom.runtime.scheduler.scheduler import Scheduler
    from tests.runtime_helpers import run_all, submit

    path = real_gguf("smollm2")
    got, _ = _scheduler_in_a_subprocess(path)
    monkeypatch.setenv("LOOM_TORCH_RUNNER", "1")
    sched = Scheduler(ServerArgs(model_path=path, max_total_tokens=1024))
    assert type(sched.runner).__name__ == "ModelRunner"
    greedy = {"temperature": 0, "ignore_eos": True}
    submit(sched, "g0", [1, 504, 3458, 282, 4649, 314, 2], {"max_new_tokens": 6, **greedy})
    submit(sched, "g1", [1, 1205, 42, 7], {"max_new_tokens": 4, **greedy})
    assert got == {k: v.ids for k, v in sorted(run_all(sched).items())}


def _maps_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()


def _engine_tokens(path: str) -> tuple[list, list[bool]]:
    """(greedy output ids of PROMPTS, whether each runtime process maps libtorch: the
    scheduler's and the detokenizer's, /proc/PID/maps)."""
    import loom

    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    with loom.Engine(path, max_total_tokens=1024) as eng:
        outs = eng.generate(input_ids=PROMPTS, sampling_params=params)
        pids = [p.pid for p in eng._procs]
        assert pids and all(os.path.exists(f"/proc/{p}") for p in pids)
        return [o["output_ids"] for o in outs], [_maps_torch(p) for p in pids]


def test_an_engine_on_the_torch_free_runner_gives_the_torch_runners_tokens(real_gguf, monkeypatch):
    path = real_gguf("smollm2")
    got, _ = _engine_tokens(path)
    monkeypatch.setenv("LOOM_TORCH_RUNNER", "1")
    ref, mapped = _engine_tokens(path)
    assert got == ref
    assert all(mapped)  # the torch runner's fork server preloads torch


def test_the_scheduler_process_never_imports_torch(real_gguf):
    _, torch_loaded = _scheduler_in_a_subprocess(real_gguf("smollm2"))
    assert not torch_loaded


def test_an_engines_processes_never_map_torch(real_gguf):
    _, mapped = _engine_tokens(real_gguf("smollm2"))
    assert len(mapped) == 2 and not any(mapped)  # the scheduler and the detokenizer
