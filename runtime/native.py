"""loom's C library: the sources in kernels/cpu/ built into one shared library per machine and
loaded with ctypes.

The library is compiled at first use with the system C compiler (seconds, not the minutes of a
torch extension: no torch headers) into the per-machine cache (~/.cache/loom/kernels, or
$LOOM_CACHE_DIR/kernels) under a name keyed by the sources, the flags, the compiler and the
CPU (-march=native code is only valid on the CPU that built it), so an edit or another machine
builds anew and everything else loads the cached file.

Invariants:
- Every function Python calls is declared LOOM_API in kernels/cpu/loom_cpu.h, and `bind`
  gives it the ctypes signature generated from that prototype: Python never declares argtypes
  by hand, and the compiler checks each definition against the same prototype.
- Every struct Python lays out too is listed in kernels/cpu/layout.c; `check_layout` /
  `check_words` / `check_constants` compare sizes, offsets and constants with the Python side
  when a module first loads the library, and raise on any difference.
- Without a compiler (or with a source that does not compile) `load` returns None and callers
  fall back to torch; under LOOM_STRICT_NATIVE=1 (CI) it raises instead, and the build adds
  -Wall -Werror, so a warning is a failure there.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from loom.runtime.env import env_flag

logger = logging.getLogger(__name__)

STRICT_NATIVE_ENV = "LOOM_STRICT_NATIVE"
LIBRARY = "loom_cpu"
HEADER = "loom_cpu.h"

_FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-std=c11", "-fvisibility=hidden"]
_STRICT_FLAGS = ["-Wall", "-Werror"]
# OpenMP for the thread team where the compiler has it (clang often lacks libomp); without it
# the pragmas are ignored (so not warned about) and every kernel runs on the calling thread
_VARIANTS = (["-fopenmp"], ["-Wno-unknown-pragmas"])
# Instruction-set variants. "native": -march=native as the build machine's cpuid reports it
# (AVX-512F where present: one zmm per 16-output panel, 16-token passes); "avx2": the same with
# AVX-512 off (two ymm per panel, 6-token passes), the path of CPUs without it, built so that
# tests exercise both. On a CPU without AVX-512F the two are the same code: "avx2" is "native".
ISA_FLAGS = {"native": (), "avx2": ("-mno-avx512f",)}


def source_dir() -> Path:
    """kernels/cpu: the C sources (shipped as package data of loom.kernels)."""
    import loom.kernels.interpret  # loom.kernels is a namespace package: locate it by a module

    return Path(loom.kernels.interpret.__file__).resolve().parent / "cpu"


def sources(directory: Path | None = None) -> list[Path]:
    """The library's translation units (every .c file of the folder), in a stable order."""
    return sorted((directory or source_dir()).glob("*.c"))


def _cache_dir() -> Path:
    return Path(os.environ.get("LOOM_CACHE_DIR", Path.home() / ".cache" / "loom")) / "kernels"


def _cpu_key() -> str:
    """-march=native code is only valid on this CPU model and flag set."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = [platform.processor()]
    return "\n".join(lines)


def _has_avx512f() -> bool:
    return re.search(r"^flags\s*:.*\bavx512f\b", _cpu_key(), re.M) is not None


def _run(cmd: list[str]) -> None:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed: {res.stderr[-2000:]}")


def _compile(compiler: str, flags: list[str], files: list[Path], target: Path) -> None:
    """Each translation unit to an object file, as many at once as there are cores (one
    compiler call for all of them compiles one after the other: ~53 s of CPU for kernels/cpu,
    wall time on one core), then one link."""
    from concurrent.futures import ThreadPoolExecutor

    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = [Path(tmp) / f"{i}_{f.stem}.o" for i, f in enumerate(files)]
        jobs = [[compiler, *flags, "-c", str(f), "-o", str(o)] for f, o in zip(files, objects)]
        with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
            for _ in pool.map(_run, jobs):  # the first failure raises, naming its errors
                pass
        out = Path(tmp) / target.name
        _run([compiler, *flags, *map(str, objects), "-o", str(out), "-lm"])
        os.replace(out, target)  # atomic: concurrent processes never load a half-written file


@contextlib.contextmanager
def _build_lock(target: Path):
    """An exclusive lock on `target`'s build (a lock file beside it): processes that need the
    same library at once (the test process and a server's scheduler, a server's ranks) wait for
    the first one's build instead of compiling it again each."""
    import fcntl

    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_suffix(".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build(files: list[Path], name: str, flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The C `files` (with the headers beside them) compiled into one shared library in the
    per-machine cache as `name`_<hash>.so, or found there, and loaded; with OpenMP where the
    compiler has it, the extra `flags`, and -Wall -Werror under LOOM_STRICT_NATIVE=1. None
    (logged) where it does not build; under LOOM_STRICT_NATIVE=1 a RuntimeError instead."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return _unavailable(name, "no C compiler found")
    strict = _STRICT_FLAGS if env_flag(STRICT_NATIVE_ENV) else []
    # the key covers every file a translation unit may include: the .c files and the headers
    deps = sorted({*files, *(p for f in files for p in f.parent.glob("*.h"))})
    text = "\0".join(f"{p.name}\0{p.read_text()}" for p in deps)
    errors = []
    for extra in _VARIANTS:
        all_flags = [*_FLAGS, *strict, *flags, *extra]
        key = hashlib.sha256(
            "\0".join([text, *all_flags, compiler, _cpu_key()]).encode()
        ).hexdigest()
        target = _cache_dir() / f"{name}_{key[:16]}.so"
        try:
            if not target.exists():
                with _build_lock(target):  # another process building it: wait, then load
                    if not target.exists():
                        _compile(compiler, all_flags, list(files), target)
            return ctypes.CDLL(str(target))
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            errors.append(str(e))
    return _unavailable(name, "; ".join(errors))


def _unavailable(name: str, why: str) -> None:
    """A library that did not build: None (callers fall back to torch), or, under
    LOOM_STRICT_NATIVE=1 (CI sets it), an error, so that a broken C edit fails its tests
    instead of turning them into skips."""
    if env_flag(STRICT_NATIVE_ENV):
        raise RuntimeError(f"{name} did not build ({STRICT_NATIVE_ENV}=1): {why}")
    logger.warning("%s unavailable (%s): falling back to torch", name, why)
    return None


# ---- signatures from the header ------------------------------------------------------------

_SCALARS = {
    "void": None,
    "int": ctypes.c_int,
    "int64_t": ctypes.c_int64,
    "uint64_t": ctypes.c_uint64,
    "float": ctypes.c_float,
    "double": ctypes.c_double,
}
_DECL = re.compile(r"\bLOOM_API\s+([^;{]*?)\s*;", re.S)
_FUNC = re.compile(r"^(?P<ret>.*?)\b(?P<name>\w+)\s*\((?P<args>.*)\)$", re.S)


def _ctype(decl: str, what: str):
    """The ctypes type of a C type (`decl` without its name): pointers as c_void_p (Python
    passes data_ptr() ints or None), `const char*` as c_char_p (bytes)."""
    decl = " ".join(decl.replace("*", " * ").split())
    if "*" in decl:
        return ctypes.c_char_p if decl in ("const char *", "char *") else ctypes.c_void_p
    base = decl.removeprefix("const ").strip()
    if base not in _SCALARS:
        raise TypeError(f"{HEADER}: {what}: type {decl!r} has no ctypes mapping in native.py")
    return _SCALARS[base]


def prototypes(header: str) -> dict[str, tuple[object, list[object]] | None]:
    """Every LOOM_API declaration of the header's text: a function's name -> (restype,
    argtypes), a variable's name -> None."""
    text = re.sub(r"/\*.*?\*/|//[^\n]*", " ", header, flags=re.S)
    out: dict[str, tuple[object, list[object]] | None] = {}
    for decl in _DECL.findall(text):
        func = _FUNC.match(decl.strip())
        if func is None:  # `extern int loom_small_attn_max`: a variable (c_int.in_dll)
            out[decl.split()[-1]] = None
            continue
        name, args = func["name"], func["args"].strip()
        params = [] if args in ("", "void") else [a.strip() for a in args.split(",")]
        argtypes = []
        for p in params:
            m = re.match(r"^(.*?)\b(\w+)$", p, re.S)  # the type, then the parameter's name
            if m is None or not m[1].strip():
                raise TypeError(f"{HEADER}: {name}: name every parameter ({p!r})")
            argtypes.append(_ctype(m[1], f"{name}({m[2]})"))
        out[name] = (_ctype(func["ret"], f"{name}'s return"), argtypes)
    return out


def bind(lib: ctypes.CDLL, header: Path) -> None:
    """Every function the header declares gets its generated signature; a declared symbol the
    library lacks is an error."""
    for name, sig in prototypes(header.read_text()).items():
        if not hasattr(lib, name):
            raise RuntimeError(f"{name} is declared in {header.name} but not in the library")
        if sig is not None:
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = sig


# ---- layouts checked against layout.c ------------------------------------------------------


class LayoutError(RuntimeError):
    """A struct or constant that Python and the C library lay out differently."""


def _entry(lib: ctypes.CDLL, key: str) -> tuple[int, int]:
    value, size = ctypes.c_int64(), ctypes.c_int64()
    if lib.loom_layout(key.encode(), ctypes.byref(value), ctypes.byref(size)) != 0:
        raise LayoutError(f"{key} is not listed in kernels/cpu/layout.c")
    return value.value, size.value


def check_layout(lib: ctypes.CDLL, name: str, struct: type[ctypes.Structure]) -> None:
    """The ctypes `struct` has the C struct `name`'s size and, field by field, its offsets and
    sizes."""
    _, size = _entry(lib, name)
    if size != ctypes.sizeof(struct):
        raise LayoutError(f"sizeof({name}) is {size} in C, {ctypes.sizeof(struct)} in Python")
    for field, *_ in struct._fields_:
        got = _entry(lib, f"{name}.{field}")
        desc = getattr(struct, field)
        if got != (desc.offset, desc.size):
            raise LayoutError(
                f"{name}.{field}: offset, size {got} in C, {(desc.offset, desc.size)} in Python"
            )


def check_words(lib: ctypes.CDLL, name: str, fields: tuple[str, ...], words: int) -> None:
    """The C struct `name` is `words` int64 words whose first are `fields` in order (a record
    Python reads through strided memoryviews)."""
    if _entry(lib, name)[1] != 8 * words:
        raise LayoutError(f"sizeof({name}) is {_entry(lib, name)[1]} in C, {8 * words} in Python")
    for i, field in enumerate(fields):
        if _entry(lib, f"{name}.{field}") != (8 * i, 8):
            raise LayoutError(f"{name}.{field} is not int64 word {i} in C")


def check_constants(lib: ctypes.CDLL, values: dict[str, int]) -> None:
    """Each C constant has the value Python uses."""
    for key, want in values.items():
        got = _entry(lib, key)[0]
        if got != want:
            raise LayoutError(f"{key} is {got} in C, {want} in Python")


# ---- the library -----------------------------------------------------------------------------

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def load(isa: str = "native") -> ctypes.CDLL | None:
    """The library for the `isa` variant (ISA_FLAGS), built once per machine and loaded once
    per process, its functions bound to the header's signatures; None without a working
    compiler (the attempt is not repeated), an error under LOOM_STRICT_NATIVE=1."""
    if isa == "avx2" and not _has_avx512f():
        isa = "native"  # -mno-avx512f changes nothing here: do not build the same code twice
    with _lock:
        if isa not in _loaded:
            lib = build(sources(), LIBRARY, ISA_FLAGS[isa])
            if lib is not None:
                bind(lib, source_dir() / HEADER)
            _loaded[isa] = lib
        return _loaded[isa]
