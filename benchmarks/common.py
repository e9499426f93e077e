"""Shared pieces of the benchmarks: the run header (machine, commit, load), A/B alternation with
median ratios, the benchmark models, and plots.

Models (`--model` in every benchmark):
  bundled         the bundled 3.9M-parameter Qwen3 model (trained), float32
  qwen0.5b-f32    a Qwen2.5-0.5B-shaped model (24 layers, hidden 896, 14/2 heads, MLP 4864) with
  qwen0.5b-bf16   random weights and the bundled 4,000-token tokenizer (so 0.36B parameters:
                  Qwen2.5-0.5B's 151,936-row embedding is the only part not reproduced), built at
                  run time into ~/.cache/loom/models/ (nothing is downloaded)
"""

from __future__ import annotations

import os
import platform
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

REPO = Path(__file__).resolve().parent.parent
IMG_DIR = REPO / "docs" / "img"
MODEL_CACHE = Path(os.environ.get("LOOM_BENCH_CACHE", Path.home() / ".cache" / "loom")) / "models"
T = TypeVar("T")
MODELS = ("bundled", "qwen0.5b-f32", "qwen0.5b-bf16")

# Qwen2.5-0.5B's config.json, less the vocabulary (the bundled tokenizer's size is used).
QWEN05B_SHAPE = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    hidden_act="silu",
)


def commit() -> str:
    """HEAD's short hash, with '+dirty' when benchmarks or the package differ from it."""
    try:
        head = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def loadavg() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def header(title: str) -> str:
    """One line naming the machine, the software and the load, printed before every table."""
    import torch

    import loom

    # a copy of the tree on PYTHONPATH (git archive + a package-dir shim) is not this checkout
    where = Path(loom.__file__).resolve().parent.parent
    source = "" if where == REPO else f" (loom imported from {where}, not this checkout)"
    return (
        f"{title}: {os.cpu_count()} CPUs ({platform.machine()}), torch {torch.__version__}, "
        f"commit {commit()}{source}, {loadavg()}"
    )


def alternate(runs: dict[str, Callable[[], T]], rounds: int) -> dict[str, list[T]]:
    """Run every labelled measurement once per round, so that machine noise lands on all of
    them alike; the order turns each round (A B, B A, A B ... ; with three, A B C, B C A, ...)
    so no side always runs first (warm caches) or last (a neighbour's burst). Returns each
    label's values in round order (seconds, or a peer's own measured figures)."""
    out: dict[str, list[T]] = {label: [] for label in runs}
    labels = list(runs)
    for r in range(rounds):
        k = r % len(labels) if labels else 0
        for label in labels[k:] + labels[:k]:
            out[label].append(runs[label]())
    return out


def post(url: str, body: dict, timeout: float = 3600) -> bytes:
    """One JSON POST on its own connection: the one HTTP client every server side shares.
    Returns the raw body (loom's /flush_cache answers plain text, as SGLang's does)."""
    import json
    import urllib.request

    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read()


def post_json(url: str, body: dict, timeout: float = 3600) -> dict:
    """post() of a request whose answer is JSON."""
    import json

    return json.loads(post(url, body, timeout))


def post_all(url: str, bodies: list[dict]) -> tuple[float, list[dict]]:
    """(seconds, responses) for every body POSTed at once, each on its own connection and
    thread: how server-to-server comparisons send a request set (loom's /generate and
    llama-server's /completion through the same client)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(bodies)) as pool:
        t = time.perf_counter()
        outs = list(pool.map(lambda b: post_json(url, b), bodies))
        return time.perf_counter() - t, outs


def ratio_summary(num: list[float], den: list[float]) -> tuple[float, float, float]:
    """Median and range of the per-round ratios num[i] / den[i]."""
    ratios = [a / b for a, b in zip(num, den, strict=True)]
    return statistics.median(ratios), min(ratios), max(ratios)


def fmt_ratio(num: list[float], den: list[float]) -> str:
    med, lo, hi = ratio_summary(num, den)
    return f"{med:.2f}x (range {lo:.2f}-{hi:.2f}, {len(num)} rounds)"


def model_path(name: str) -> str:
    """The folder of a benchmark model by name (see the module docstring), building it once."""
    from loom.runtime.server_args import BUNDLED_MODEL_PATH

    if name == "bundled":
        return str(BUNDLED_MODEL_PATH)
    if name not in MODELS:
        raise ValueError(f"--model: must be one of {MODELS} or a folder, got {name!r}")
    dtype = name.rsplit("-", 1)[1]
    path = MODEL_CACHE / name
    if not (path / "model.safetensors").exists():
        _build_random_qwen(path, dtype)
    return str(path)


def resolve_model(arg: str | None) -> tuple[str, str]:
    """(label, folder) for a --model argument: a benchmark model name or a folder."""
    if arg is None:
        arg = "bundled"
    if arg in MODELS:
        return arg, model_path(arg)
    if not Path(arg, "config.json").exists():
        raise ValueError(f"--model: {arg!r} is neither one of {MODELS} nor a model folder")
    return Path(arg).name, arg


def _build_random_qwen(path: Path, dtype: str) -> None:
    import torch
    import transformers

    from loom.runtime.server_args import BUNDLED_MODEL_PATH

    bundled = Path(BUNDLED_MODEL_PATH)
    tok = transformers.AutoTokenizer.from_pretrained(bundled)
    cfg = transformers.Qwen2Config(
        vocab_size=len(tok),
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **QWEN05B_SHAPE,
    )
    torch.manual_seed(0)
    t = time.perf_counter()
    model = transformers.Qwen2ForCausalLM(cfg).to(
        {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
    )
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bundled / f, tmp / f)
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    n = sum(p.numel() for p in model.parameters())
    print(f"built {path} ({n / 1e6:.0f}M parameters, {dtype}) in {time.perf_counter() - t:.0f} s")


def plot(
    filename: str,
    title: str,
    xlabel: str,
    ylabel: str,
    series: dict[str, tuple[list[float], list[float]]],
    *,
    logx: bool = False,
    logy: bool = False,
    kind: str = "line",
) -> Path | None:
    """Write docs/img/<filename> (a line or box plot); None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install -e .[bench]): no plot written")
        return None
    IMG_DIR.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
    if kind == "box":
        labels = list(series)
        ax.boxplot([series[k][1] for k in labels], whis=(1, 99), showfliers=False)
        ax.set_xticks(range(1, len(labels) + 1), labels)
    else:
        for label, (xs, ys) in series.items():
            ax.plot(xs, ys, marker="o", label=label)
        ax.legend(fontsize=8)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.text(
        0.99,
        0.01,
        f"commit {commit()}",
        transform=ax.transAxes,
        fontsize=6,
        ha="right",
        va="bottom",
    )
    fig.tight_layout()
    out = IMG_DIR / filename
    fig.savefig(out)
    plt.close(fig)
    print(f"plot {out.relative_to(REPO)}")
    return out
