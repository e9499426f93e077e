"""Drive the scheduler in-process: submit requests, step until idle, gather results."""

from __future__ import annotations

from dataclasses import dataclass, field

from loom.runtime.detokenizer import Detokenizer
from loom.runtime.io_struct import BatchTokenIDOut, TokenizedGenerateReq
from loom.runtime.sampling_params import make_sampling_params
from loom.runtime.scheduler.scheduler import Scheduler
from loom.runtime.server_args import ServerArgs


@dataclass
class Result:
    ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: dict | None = None
    cached_tokens: int = 0
    input_logprobs: list = field(default_factory=list)
    output_logprobs: list = field(default_factory=list)
    output_top: list = field(default_factory=list)
    chunks: list[str] = field(default_factory=list)


def make_scheduler(path: str, **kwargs) -> Scheduler:
    """An in-process scheduler whose grammar backend is built before it returns (unless
    `grammar_backend_eager=False` is passed): the tests submit free and constrained requests
    together and compare one batch's steps; with the server's default (the backend built by
    the first constrained request, on a thread) the constrained ones would wait out the build
    while the free ones ran alone, a batch that depends on the build's time."""
    kwargs.setdefault("max_total_tokens", 8192)
    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("grammar_backend_eager", True)
    sched = Scheduler(ServerArgs(model_path=path, **kwargs))
    sched.grammar_queue.wait_ready()
    sched.check_integrity_every_step = True
    return sched


def batch_invariant_scheduler(path: str, **kwargs) -> Scheduler:
    """A GGUF model kept quantized, every matmul in the batch-invariant kernels (one arithmetic
    for every row count, so greedy speculation equals plain decoding bitwise), jump-forward off
    (its forced tokens would change the step sizes the tests compare)."""
    return make_scheduler(
        path, quantization="gguf", quantized_matmul="batch-invariant",
        disable_jump_forward=True, **kwargs,
    )  # fmt: skip


def submit(sched: Scheduler, rid: str, ids: list[int], params: dict, seed: int = 0, **kw) -> None:
    sched.add_request(
        TokenizedGenerateReq(
            rid=rid,
            input_ids=list(ids),
            sampling_params=make_sampling_params(params),
            seed=seed,
            **kw,
        )
    )


def run_all(sched: Scheduler, max_steps: int = 100_000) -> dict[str, Result]:
    detok = Detokenizer(sched.tokenizer)
    results: dict[str, Result] = {}
    for _ in range(max_steps):
        outs = sched.step()
        if outs:
            for item in detok.handle(BatchTokenIDOut(outs)).outputs:
                r = results.setdefault(item.rid, Result())
                tok = item.token
                r.ids.extend(tok.new_ids)
                r.text += item.text_delta
                r.chunks.append(item.text_delta)
                r.finish_reason = tok.finished_reason
                r.cached_tokens = tok.cached_tokens
                if tok.input_token_logprobs is not None:
                    r.input_logprobs = tok.input_token_logprobs
                r.output_logprobs.extend(tok.output_token_logprobs or [])
                r.output_top.extend(tok.output_top_logprobs or [])
        if sched.is_idle and not sched.pending_outputs:
            sched.check_integrity()
            return results
    raise AssertionError("scheduler did not become idle")


def greedy(max_new: int = 24, **extra) -> dict:
    return {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True, **extra}


def free_head(sched: Scheduler) -> Scheduler:
    """A head drafter whose gate counts no cost for the head's draft levels. On the tiny test
    models a level reads over half the weights a target step does, so the gate (rightly) cuts
    chains short; tests of what drafting does (drafts against references, identity under
    rejection) draft full length. Verify costs and measured rates still apply. The head's
    time is not charged to constrained requests either (`NgramPolicy.free`): with both, no
    drafting decision reads a clock."""
    drafter = sched.decode.drafter
    gate = getattr(drafter, "gate", None)  # None: no head drafter
    if gate is not None:
        gate.per_level, gate.pinned = 0.0, True
        drafter.policy.free = True
    return sched


def settle_grammars(sched: Scheduler, timeout: float = 120.0) -> None:
    """Wait until every submitted constrained request's grammar (and closer) is compiled, so
    the next step admits them all: a batch whose make-up does not depend on compile times
    (verify counts then repeat run to run)."""
    import time

    q = sched.grammar_queue
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        futs = [f for _, f, _ in q.pending] + list(q.closers.values())
        if all(f is not None and f.done() for f in futs):
            return
        time.sleep(0.005)
    raise AssertionError("grammars did not compile in time")


def run_chats(sched: Scheduler, asks: list[str], max_new: int) -> dict[str, Result]:
    """Each ask as one user turn through the model's chat template (request p{i}, greedy
    `max_new` tokens), all submitted at once and run to the end."""
    tok = sched.tokenizer
    for i, a in enumerate(asks):
        ids = tok.apply_chat_template(
            [{"role": "user", "content": a}], add_generation_prompt=True, tokenize=True
        )
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids
        submit(sched, f"p{i}", list(ids), greedy(max_new))
    return run_all(sched)


def run_child(script: str, *args: str, timeout: float = 300, cwd: str | None = None) -> list[str]:
    """Run `python -c script args...` in a fresh interpreter (the tests that a process never
    imports torch need one); its stdout lines, after asserting it exited 0."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                         timeout=timeout, cwd=cwd)  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()
