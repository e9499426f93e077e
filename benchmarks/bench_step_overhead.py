"""A decode step's CPU time around the model forward: scheduling, batch building, sampling,
result processing and output messages, in one in-process scheduler on one thread.

Per batch size B, B requests of --pp random prompt tokens generate --tg tokens (greedy unless
--temperature, ignore_eos, streamed so every step makes B outputs, radix cache off). Figures
are this thread's CPU time (so the other processes' load inflates them less than wall time),
the median over the full-batch decode steps: the whole step, the model forward (the compiled
C forward or the eager modules), and the parts around it: `schedule` (decode batch and its KV
slots), `build` (the step's index tensors and sampling parameters), `runner` (the runner's
own work besides the forward and sampling), `sample`, `process` (tokens into requests, stop
checks) and `drain` (the output messages).

    python benchmarks/bench_step_overhead.py [--batch-sizes 1,8,64] [--pp 128] [--tg 32]
        [--rounds 3] [--temperature 0] [--base-tree DIR] [--engine [--engine-tg 512]]

--engine adds, per side, a streamed run through a whole Engine (B requests of --pp tokens,
--engine-tg new tokens each): the CPU milliseconds per decode token-step (prefill included) of
the caller's process (tokenizer manager, the Engine's stream), the detokenizer and the
scheduler, from the processes' own CPU counters, and the wall milliseconds per step. Those
counters tick every 10 ms, so the run is long (default 512 steps: 0.02 ms a tick per step;
at 32 steps one tick is 0.31 ms, which is all a detokenizer's count then said).

--base-tree DIR compares against another copy of the source tree laid out like this one (for
example `git archive HEAD~1 | tar -x -C DIR`): each round runs both trees, alternating, each
in a fresh subprocess, and the table gives both sides and the per-round ratio base / this
tree of the time outside the forward. --tree DIR measures that copy instead of the installed
loom (so that others' uncommitted edits in a shared checkout stay out of both sides).

--model picks the model (default the bundled one; a GGUF file or name such as smollm2, with
--quantization gguf to keep its blocks); where the compiled C forward runs, `mm` and `attn`
split its time into the matmuls and the attention (CpuForward.profile, ArrayForward.profile).
A GGUF model on default flags runs the torch-free ArrayRunner, as a server would: `model` is
then its `_logits` (the C forward and its ctypes call). `sample` is step_output.sample_step as
either runner calls it (ModelRunner's `_sample` is gone: the script failed on both runners).
`wall` is the step's wall time beside its CPU time `step`: a gap between them is waiting
(or, on a loaded machine, the other processes' turns).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

PARTS = ("schedule", "build", "runner", "model", "sample", "process", "drain")
SPLIT = ("mm", "attn")  # the C forward's own split of "model" (CpuForward.profile)


def model_path(arg: str) -> str:
    """--model: a benchmark model name or folder (common.resolve_model), or a GGUF file / name"""
    if arg.endswith(".gguf"):
        return arg
    if arg in common.MODELS or Path(arg, "config.json").exists():
        return common.resolve_model(arg)[1]
    from loom.runtime.gguf.named import resolve_model_name

    return resolve_model_name(arg)


def _wrap(obj, name: str, key: str, spent: dict) -> None:
    fn = getattr(obj, name)

    def timed(*a, **kw):
        t = time.thread_time()
        try:
            return fn(*a, **kw)
        finally:
            spent[key] += time.thread_time() - t

    setattr(obj, name, timed)


def _split_timed(fn, prof, spent: dict):
    """fn timed as `model`, with the C forward's profile counters `prof` (matmul, attention
    CPU seconds; CpuForward.profile or ArrayForward.profile) split into `mm` and `attn`"""

    def timed(*a, **kw):
        t, before = time.thread_time(), [float(v) for v in prof]
        try:
            return fn(*a, **kw)
        finally:
            spent["model"] += time.thread_time() - t
            spent["mm"] += float(prof[0]) - before[0]
            spent["attn"] += float(prof[1]) - before[1]

    return timed


def measure(
    sizes: list[int], pp: int, tg: int, temperature: float, model: str, quantization: str | None
) -> dict:
    """{B: {part: median CPU ms, and "wall": the step's median wall ms}} for this process's
    loom. Either runner: the torch-free ArrayRunner (a GGUF model on default flags) or
    ModelRunner."""
    from loom.runtime.io_struct import TokenizedGenerateReq
    from loom.runtime.runner_choice import choose
    from loom.runtime.sampling_params import make_sampling_params
    from loom.runtime.scheduler.batch import ScheduleBatch
    from loom.runtime.scheduler.scheduler import Scheduler
    from loom.runtime.server_args import ServerArgs

    args = ServerArgs(
        model_path=model_path(model),
        quantization=quantization,
        cpu_threads=1,
        max_running_requests=max(sizes),
        disable_radix_cache=True,
        log_level="warning",
    )
    if not choose(args):  # ModelRunner: its torch ops on one thread too
        import torch

        torch.set_num_threads(1)
    sched = Scheduler(args)
    spent = dict.fromkeys(PARTS + SPLIT, 0.0)
    runner = sched.runner
    _wrap(sched.decode, "schedule", "schedule", spent)
    _wrap(ScheduleBatch, "build_input", "build", spent)
    _wrap(runner, "forward", "runner", spent)
    if hasattr(runner, "forward_impl"):  # ArrayRunner: the C forward over numpy arrays
        import numpy as np

        import loom.runtime.array_runner as array_runner

        _wrap(array_runner, "sample_step", "sample", spent)
        runner.forward_impl.profile = prof = np.zeros(2)
        runner._logits = _split_timed(runner._logits, prof, spent)
    else:
        import loom.runtime.model_runner as model_runner

        _wrap(model_runner, "sample_step", "sample", spent)
        _wrap(runner.model, "forward", "model", spent)
    if getattr(runner, "cpu_forward", None) is not None:
        import torch

        compiled = runner.cpu_forward
        compiled.profile = prof = torch.zeros(2, dtype=torch.float64)

        class Timed:  # the runner also reads the forward's `covers`
            covers = compiled.covers
            __call__ = staticmethod(_split_timed(compiled, prof, spent))

        runner.cpu_forward = Timed()
    _wrap(sched.output, "process", "process", spent)
    _wrap(sched.output, "drain", "drain", spent)
    vocab = sched.vocab_size
    rng = random.Random(0)
    params = make_sampling_params(
        {"max_new_tokens": tg, "temperature": temperature, "ignore_eos": True}
    )

    def run(b: int) -> list[dict]:
        for i in range(b):
            ids = [rng.randrange(10, vocab) for _ in range(pp)]
            sched.add_request(
                TokenizedGenerateReq(
                    rid=f"r{i}", input_ids=ids, sampling_params=params, seed=i, stream=True
                )
            )
        steps = []
        while not sched.is_idle:
            for k in spent:
                spent[k] = 0.0
            t, w = time.thread_time(), time.perf_counter()
            sched.step()
            step, wall = time.thread_time() - t, time.perf_counter() - w
            if len(sched.decode.running) == b and spent["model"]:
                steps.append({"step": step, "wall": wall, **spent})
        return steps[1:]  # the first full-batch step follows the prefill

    run(max(sizes))  # warm-up: first GEMMs, the allocator
    out = {}
    for b in sizes:
        steps = run(b)
        keys = ("step", "wall", *PARTS, *SPLIT)
        med = {k: statistics.median(s[k] for s in steps) * 1e3 for k in keys}
        med["runner"] -= med["model"] + med["sample"]
        med["outside"] = med["step"] - med["model"]
        out[b] = med
    return out


def measure_engine(sizes: list[int], pp: int, tg: int, temperature: float) -> dict:
    """{B: {process: CPU ms per step}} of a streamed generation through an Engine."""
    import psutil

    import loom

    _, path = common.resolve_model("bundled")
    engine = loom.Engine(
        path, max_running_requests=max(sizes), random_seed=0, cpu_threads=1, log_level="warning"
    )
    try:
        engine.generate(input_ids=[[5, 6, 7, 8]], sampling_params={"max_new_tokens": 4})
        procs = {"caller": psutil.Process()}
        for proc in engine._procs:  # multiprocessing names them
            for role in ("scheduler", "detokenizer"):
                if role in proc.name:
                    procs[role] = psutil.Process(proc.pid)

        def cpu() -> dict:
            return {k: sum(p.cpu_times()[:2]) for k, p in procs.items()}

        rng = random.Random(1)
        params = {"max_new_tokens": tg, "temperature": temperature, "ignore_eos": True}
        out = {}
        for b in sizes:
            prompts = [[rng.randrange(10, 4000) for _ in range(pp)] for _ in range(b)]
            before, t = cpu(), time.perf_counter()
            for _ in engine.generate(input_ids=prompts, sampling_params=params, stream=True):
                pass
            wall = time.perf_counter() - t
            after = cpu()
            out[b] = {k: (after[k] - before[k]) * 1e3 / tg for k in procs}
            out[b]["wall"] = wall * 1e3 / tg
        return out
    finally:
        engine.shutdown()


def _shim(tree: Path, into: Path) -> Path:
    """A folder that imports `loom` from `tree` (the setuptools package-dir layout)."""
    pkg = into / "loom"
    pkg.mkdir(parents=True)
    for item in (tree / "lang").iterdir():
        (pkg / item.name).symlink_to(item)
    for sub in ("runtime", "grammar", "radix", "kernels"):
        (pkg / sub).symlink_to(tree / sub)
    return into


def _run_tree(args, pythonpath: str | None) -> dict:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, __file__, "--worker", "--batch-sizes", args.batch_sizes]
    cmd += ["--pp", str(args.pp), "--tg", str(args.tg), "--temperature", str(args.temperature)]
    cmd += ["--model", args.model, "--quantization", args.quantization]
    cmd += ["--engine", "--engine-tg", str(args.engine_tg)] if args.engine else []
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return {int(k): v for k, v in json.loads(res.stdout.strip().splitlines()[-1]).items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batch-sizes", default="1,8,64")
    p.add_argument("--pp", type=int, default=128)
    p.add_argument("--tg", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--base-tree", default=None)
    p.add_argument("--tree", default=None)
    p.add_argument("--engine", action="store_true")
    p.add_argument("--engine-tg", type=int, default=512)
    p.add_argument("--model", default="bundled", help="model name, folder or GGUF file")
    p.add_argument("--quantization", default="", help="loom's --quantization ('': none)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.worker:
        res = measure(
            sizes, args.pp, args.tg, args.temperature, args.model, args.quantization or "none"
        )
        if args.engine:
            engine = measure_engine(sizes, args.pp, args.engine_tg, args.temperature)
            for b, parts in engine.items():
                res[b].update({f"engine {k}": v for k, v in parts.items()})
        print(json.dumps(res))
        return
    print(
        common.header(
            f"decode step around the forward ({args.model}"
            f"{' ' + args.quantization if args.quantization else ''}, 1 thread, "
            f"T={args.temperature})"
        )
    )
    with tempfile.TemporaryDirectory() as tmp:
        sides = {"this tree": None}
        if args.tree:
            sides["this tree"] = str(_shim(Path(args.tree).resolve(), Path(tmp) / "tree"))
        if args.base_tree:
            base = _shim(Path(args.base_tree).resolve(), Path(tmp) / "base")
            sides = {"base": str(base), **sides}
        runs = {name: (lambda pp=pp: _run_tree(args, pp)) for name, pp in sides.items()}
        res = common.alternate(runs, args.rounds)
    cols = ("wall", "step", "model", *SPLIT, "outside", *[k for k in PARTS if k != "model"])
    print(f"| B | side | load | {' | '.join(cols)} |")
    print("|---|---|---|" + "---|" * len(cols))
    load = os.getloadavg()[0]
    for b in sizes:
        for name, rounds in res.items():
            med = {k: statistics.median(r[b][k] for r in rounds) for k in cols}
            print(
                f"| {b} | {name} | {load:.1f} | " + " | ".join(f"{med[k]:.3f}" for k in cols) + " |"
            )
    if args.engine:
        procs = ("caller", "detokenizer", "scheduler", "wall")
        print()
        print(f"| B | side | engine ms per step ({args.engine_tg} steps), CPU: "
              + " | ".join(procs) + " |")  # fmt: skip
        print("|---|---|" + "---|" * len(procs))
        for b in sizes:
            for name, rounds in res.items():
                med = [statistics.median(r[b][f"engine {k}"] for r in rounds) for k in procs]
                print(f"| {b} | {name} | " + " | ".join(f"{m:.2f}" for m in med) + " |")
    if args.base_tree:
        print()
        print("| B | outside the forward, base / this tree | whole step, base / this tree |")
        print("|---|---|---|")
        for b in sizes:
            base, new = res["base"], res["this tree"]
            print(
                f"| {b} | {common.fmt_ratio([r[b]['outside'] for r in base], [r[b]['outside'] for r in new])} "
                f"| {common.fmt_ratio([r[b]['step'] for r in base], [r[b]['step'] for r in new])} |"
            )


if __name__ == "__main__":
    main()
