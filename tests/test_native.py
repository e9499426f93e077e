"""loom's C library (runtime/native.py, kernels/cpu/): C lives in .c/.h files only, the build
turns warnings into errors under LOOM_STRICT_NATIVE=1, the ctypes signatures come from the
header, and the structs Python lays out match the C ones."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

from loom.runtime import native

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("lang", "runtime", "grammar", "radix", "kernels", "benchmarks", "scripts", "tests")
# what C source looks like and Python does not: a preprocessor line, a struct typedef, an
# OpenMP pragma (spelled in pieces so that this file does not match itself)
C_MARKERS = re.compile(
    "|".join(
        [
            r"^\s*#\s*" + "include" + r"\s*[<\"]",
            r"^\s*#\s*" + "define" + r"\s+\w+",
            r"\btypedef\s+" + "struct" + r"\b",
            r"#\s*" + "pragma" + r"\s+omp\b",
        ]
    ),
    re.M,
)


def test_no_c_source_in_python_files():
    offenders = [
        f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0).strip()}"
        for pkg in PACKAGES
        for path in sorted((ROOT / pkg).rglob("*.py"))
        for text in [path.read_text()]
        for m in C_MARKERS.finditer(text)
    ]
    assert not offenders, "C source inside .py files (it belongs in kernels/cpu/):\n" + "\n".join(
        offenders
    )


def test_every_source_is_in_kernels_cpu():
    names = {p.name for p in native.sources()}
    assert {"attention.c", "forward.c", "heads.c", "ngram_store.c", "layout.c"} <= names
    assert (native.source_dir() / native.HEADER).is_file()
    assert (native.source_dir() / ".clang-format").is_file()


def _write(directory: Path, body: str) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    src = directory / "probe.c"
    src.write_text('#include <stdint.h>\n__attribute__((visibility("default")))\n' + body)
    return [src]


WARNS = "int64_t probe(int64_t x) {\n    int64_t unused = x;\n    return x + 1;\n}\n"
CLEAN = "int64_t probe(int64_t x) { return x + 1; }\n"


def test_strict_build_turns_a_warning_into_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path / "cache"))
    files = _write(tmp_path / "src", WARNS)
    monkeypatch.delenv(native.STRICT_NATIVE_ENV, raising=False)
    lib = native.build(files, "probe")  # a warning only: it builds and runs
    assert lib is not None and lib.probe(41) == 42
    monkeypatch.setenv(native.STRICT_NATIVE_ENV, "1")
    with pytest.raises(RuntimeError, match="unused"):
        native.build(files, "probe")


def test_broken_source_fails_strict_and_falls_back_otherwise(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path / "cache"))
    files = _write(tmp_path / "src", "int64_t probe(int64_t x) { return x + ; }\n")
    monkeypatch.setenv(native.STRICT_NATIVE_ENV, "1")
    with pytest.raises(RuntimeError, match="did not build"):
        native.build(files, "probe")
    monkeypatch.setenv(native.STRICT_NATIVE_ENV, "0")
    assert native.build(files, "probe") is None


def test_cache_is_keyed_by_the_sources(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(native.STRICT_NATIVE_ENV, raising=False)
    files = _write(tmp_path / "src", CLEAN)
    first = native.build(files, "probe")
    again = native.build(files, "probe")
    assert first._name == again._name  # found in the cache, not rebuilt under another name
    (tmp_path / "src" / "extra.h").write_text("/* a header beside the sources */\n")
    assert native.build(files, "probe")._name != first._name
    built = sorted(p.name for p in (tmp_path / "cache" / "kernels").glob("probe_*.so"))
    assert len(built) == 2


def test_prototypes_become_ctypes_signatures():
    header = """
    /* LOOM_API void commented_out(int x); */
    LOOM_API int64_t f(const float* x, int64_t n, float eps,
                       double* prof, int threads);
    LOOM_API void g(void);
    LOOM_API int named(const char* name, int64_t* value);
    LOOM_API extern int knob;
    static inline int not_api(int x) { return x; }
    """
    sigs = native.prototypes(header)
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    assert sigs == {
        "f": (i64, [p, i64, ctypes.c_float, p, ctypes.c_int]),
        "g": (None, []),
        "named": (ctypes.c_int, [ctypes.c_char_p, p]),
        "knob": None,
    }
    with pytest.raises(TypeError, match="name every parameter"):
        native.prototypes("LOOM_API void h(int64_t);")
    with pytest.raises(TypeError, match="no ctypes mapping"):
        native.prototypes("LOOM_API void h(size_t n);")


@pytest.fixture(scope="module")
def lib():
    lib = native.load()
    if lib is None:
        pytest.skip("no C compiler")
    return lib


def test_header_and_library_agree(lib, tmp_path):
    header = (native.source_dir() / native.HEADER).read_text()
    sigs = native.prototypes(header)
    assert len(sigs) >= 25 and sigs["loom_forward_f32"][0] is ctypes.c_int
    assert len(sigs["loom_forward_f32"][1]) == 22
    for name, sig in sigs.items():
        if sig is not None:
            fn = getattr(lib, name)
            assert (fn.restype, fn.argtypes) == (sig[0], sig[1]), name
    fake = tmp_path / "loom_cpu.h"
    fake.write_text(header + "\nLOOM_API void loom_not_built(void);\n")
    with pytest.raises(RuntimeError, match="loom_not_built"):
        native.bind(lib, fake)


def test_layouts_match_and_a_mismatch_is_caught(lib):
    from loom.runtime import cpu_forward
    from loom.runtime.spec import head_kernel, ngram_store_c

    for module in (cpu_forward, head_kernel, ngram_store_c):
        assert module.load() is lib  # one library; each module's structs checked on load

    fields = list(cpu_forward._Layer._fields_)
    fields[0], fields[1] = fields[1], fields[0]  # same size, two fields swapped
    swapped = type("Swapped", (ctypes.Structure,), {"_fields_": fields})
    with pytest.raises(native.LayoutError, match="Layer.qkv_w"):
        native.check_layout(lib, "Layer", swapped)
    short = type("Short", (ctypes.Structure,), {"_fields_": cpu_forward._Layer._fields_[:-1]})
    with pytest.raises(native.LayoutError, match="sizeof"):
        native.check_layout(lib, "Layer", short)
    narrow = [*head_kernel._Head._fields_[:-1], ("bf16_inputs", ctypes.c_int32)]
    narrow_head = type("Narrow", (ctypes.Structure,), {"_fields_": narrow})
    with pytest.raises(native.LayoutError):  # sizeof may pad to the same; the field's size not
        native.check_layout(lib, "Head", narrow_head)
    with pytest.raises(native.LayoutError, match="NGT_GROW"):
        native.check_constants(lib, {"NGT_GROW": 1})
    with pytest.raises(native.LayoutError, match="not listed"):
        native.check_constants(lib, {"NO_SUCH_CONSTANT": 0})
    with pytest.raises(native.LayoutError, match="Node.count"):
        native.check_words(lib, "Node", ("parent", "count", "token"), 16)


def test_one_library_for_every_module(lib):
    from loom.runtime import cpu_kernels

    assert cpu_kernels.load() is lib
    exported = {
        name
        for name, sig in native.prototypes(
            (native.source_dir() / native.HEADER).read_text()
        ).items()
    }
    # the forward, the heads, the attention kernels and the n-gram store in one library
    assert {"loom_forward_f32", "loom_eagle_round", "loom_decode_f32", "ngt_extend"} <= exported
