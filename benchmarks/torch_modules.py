"""Which of loom's modules a GGUF scheduler loads import torch at the top (issue 32's port).

One process builds the scheduler the way the scheduler process builds it (`Scheduler(args)`,
without the fork server's preload), on a GGUF model the C forward covers, and runs a few
greedy requests, one with a shared prefix (the radix cache's path) and, with --grammar, one
constrained by a regex (the grammar backend's path). Then it lists every `loom.*` module in
`sys.modules` and reads its source: a module-level `import torch` / `from torch ...` (not one
inside a function, nor under `if TYPE_CHECKING:`) counts. Also printed: the module whose import first pulled torch in, and
the process's VmHWM (which includes torch whenever any module imports it).

    python benchmarks/torch_modules.py [--gguf smollm2] [--grammar] [--list]
"""

from __future__ import annotations

import argparse
import ast
import builtins
import os
import sys
import time
import traceback

ROOT = ""  # the loom source tree this python imports (set in main)

_first_torch: list[str] = []
_real_import = builtins.__import__


def _watch(name, globals=None, locals=None, fromlist=(), level=0):  # noqa: A002
    """Record the loom frames of the import that first loads torch."""
    if not _first_torch and (name == "torch" or name.startswith("torch.")):
        if "torch" not in sys.modules:
            frames = [
                f"{os.path.relpath(f.filename, ROOT)}:{f.lineno}"
                for f in traceback.extract_stack()[:-1]
                if f.filename.startswith(ROOT) and f.filename != __file__
            ]
            _first_torch.append(" <- ".join(reversed(frames[-4:])) or "?")
    return _real_import(name, globals, locals, fromlist, level)


def top_level_torch(path: str) -> bool:
    """Whether the module's source imports torch outside any function or class body."""
    tree = ast.parse(open(path, encoding="utf-8").read())

    def walk(nodes) -> bool:
        for node in nodes:
            if isinstance(node, ast.Import):
                if any(a.name == "torch" or a.name.startswith("torch.") for a in node.names):
                    return True
            elif isinstance(node, ast.ImportFrom):
                if node.module and (node.module == "torch" or node.module.startswith("torch.")):
                    return True
            elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue  # never runs
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                bodies = [node.body, getattr(node, "orelse", []), getattr(node, "finalbody", [])]
                bodies += [h.body for h in getattr(node, "handlers", [])]
                if any(walk(b) for b in bodies):
                    return True
        return False

    return walk(tree.body)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gguf", default="smollm2")
    p.add_argument("--grammar", action="store_true", help="also run a regex-constrained request")
    p.add_argument("--list", action="store_true", help="print the modules, not only the counts")
    a = p.parse_args()
    global ROOT
    import loom

    ROOT = os.path.dirname(os.path.dirname(os.path.abspath(loom.__file__)))  # lang/..
    builtins.__import__ = _watch

    from loom.runtime.gguf.named import resolve_model_name
    from loom.runtime.io_struct import TokenizedGenerateReq
    from loom.runtime.sampling_params import make_sampling_params
    from loom.runtime.scheduler.scheduler import Scheduler
    from loom.runtime.server_args import ServerArgs

    path = a.gguf if a.gguf.endswith(".gguf") else resolve_model_name(a.gguf)
    args = ServerArgs(
        model_path=path, max_total_tokens=2048, cpu_threads=1, grammar_backend_eager=a.grammar
    )
    sched = Scheduler(args)
    sched.grammar_queue.wait_ready()  # the backend's modules load before the counting
    prompt = list(range(100, 164))
    reqs = [("a", prompt, {}), ("b", prompt + [7, 8, 9], {})]
    if a.grammar:
        reqs.append(("c", prompt[:8], {"regex": "[a-z]{3,6}"}))
    for rid, ids, extra in reqs:
        params = make_sampling_params({"temperature": 0, "max_new_tokens": 4, **extra})
        sched.add_request(
            TokenizedGenerateReq(rid=rid, input_ids=ids, sampling_params=params, seed=0)
        )
        for _ in range(2000):
            sched.step()
            if sched.is_idle:
                break
            if sched.only_waiting_for_grammar:
                time.sleep(0.01)
        assert sched.is_idle, f"request {rid} did not finish"
    builtins.__import__ = _real_import

    loaded = sorted(n for n in sys.modules if n == "loom" or n.startswith("loom."))
    with_torch = []
    for name in loaded:
        f = getattr(sys.modules[name], "__file__", None)
        if f and f.endswith(".py") and top_level_torch(f):
            with_torch.append(name)
    hwm = next(
        (line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM")), "?"
    )
    print(f"model: {path}")
    print(f"loom modules loaded: {len(loaded)}; importing torch at the top: {len(with_torch)}")
    print(f"torch loaded: {'torch' in sys.modules}; first pulled in by: {_first_torch[:1]}")
    print(f"VmHWM: {int(hwm) / 1024:.1f} MB (this process: scheduler + this script)")
    if a.list:
        for name in with_torch:
            print("  torch:", name)


if __name__ == "__main__":
    main()
