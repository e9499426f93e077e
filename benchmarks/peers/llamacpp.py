"""llama.cpp as loom's CPU peer: build it, convert the same model, check it, benchmark it.

Optional and never a test or CI dependency. Everything is cached under ~/.cache/loom/llamacpp:

  build     llama.cpp's tools from the llama-cpp-python source distribution (its vendor/llama.cpp;
            `pip download --no-binary :all:`), cmake Release with GGML_NATIVE=ON, the web UI off
            (LLAMA_USE_PREBUILT_UI=OFF, else the build downloads one); targets llama-server and
            llama-batched-bench (~15 min on 2 idle cores, once).
  convert   the benchmark model (benchmarks/common.py: bundled, qwen0.5b-f32, qwen0.5b-bf16) to
            GGUF at the same dtype with llama.cpp's convert_hf_to_gguf.py. The models' pre-tokenizers
            have no hash in llama.cpp's table (its hashes are of whole vocabularies), so each is
            mapped explicitly to the llama.cpp pre-tokenizer whose split equals the one the HF
            tokenizer (transformers.AutoTokenizer, as loom and the HF baselines load it) applies:
            the bundled Qwen3 model keeps tokenizer.json's (individual digits, then GPT-2's
            ByteLevel regex) = "refact"; for a Qwen2 config transformers 5 loads Qwen2Tokenizer,
            which replaces it with Qwen2's regex ("\\n\\n" is one piece there, two in GPT-2's)
            = "qwen2". A model whose split equals no candidate is refused.
  check     llama-server's /tokenize equals the HF tokenizer on sample texts, and greedy tokens
            from llama-server, on the settings that are timed (f16 KV, -fa auto and off), equal
            loom's on the same token-id prompts; a difference fails it unless loom's top two
            candidates there are a near tie (NEAR_TIE: the KV precisions differ).
  offline   bench_offline's workload (same requests) through llama-server: -np = the number of
            requests, llama.cpp's default per-slot KV (or --kv-unified: both are rows), token-id
            prompts, cache_prompt off, the same thread count; useful tok/s, sent by the same
            client (common.post_all) that sends them to a loom server. Rows for llama.cpp's
            default (-fa auto) and -fa off.
  batched   llama-batched-bench: prefill and decode tok/s at batch sizes 1/8/32/64.
  gguf      llama-batched-bench on a given GGUF file (--gguf; -fa on and off): a real model's
            own quantized file, as bench_real.py compares loom with it.

    python benchmarks/peers/llamacpp.py all --model bundled [--threads 1]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import time
import urllib.request
from contextlib import ExitStack, contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import common  # noqa: E402

CACHE = Path(os.environ.get("LOOM_BENCH_CACHE", Path.home() / ".cache" / "loom")) / "llamacpp"
TARGETS = ("llama-server", "llama-batched-bench")
# GPT-2's split as HF and llama.cpp's hand-written splitter for it (unicode.cpp) apply it.
GPT2_REGEX = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Qwen2's split as llama.cpp writes it (llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_QWEN2).
QWEN2_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SAMPLES = [
    "Hello world! The year 2024 had 366 days.",
    "  leading spaces,\ttabs\n\nand new lines   ",
    "I've been told he's there, 'RE you sure? We'Ve a'lL",
    "3.14159 + 2e10 = ?? -- 1,000,000 $$ 50%",
    "naïve café résumé — “quotes” and emojis 🚀🦙",
    "def f(x):\n    return x**2  # comment",
    "<|im_start|>user\nWhat is 12*34?<|im_end|>\n<|im_start|>assistant\n",
    "line one\r\n\r\n  line two\n \n3rd DON'T   \n\tend",
]


def source_dir() -> Path:
    """vendor/llama.cpp of the llama-cpp-python sdist, downloaded and unpacked once."""
    found = sorted(CACHE.glob("*/llama_cpp_python-*/vendor/llama.cpp/CMakeLists.txt"))
    if found:
        return found[-1].parent
    dl = CACHE / "sdist"
    dl.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
         "llama-cpp-python", "-d", str(dl)],
        check=True,
    )  # fmt: skip
    sdist = sorted(dl.glob("llama_cpp_python-*.tar.gz"))[-1]
    version = sdist.name.removeprefix("llama_cpp_python-").removesuffix(".tar.gz")
    with tarfile.open(sdist) as tf:
        tf.extractall(CACHE / version, filter="data")
    return CACHE / version / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"


def built() -> bool:
    """Whether a cached build has both tools (downloads and builds nothing)."""
    return any(all((d / "bin" / t).exists() for t in TARGETS) for d in CACHE.glob("*/build"))


def build_dir() -> Path:
    return source_dir().parents[2] / "build"


def build(jobs: int = 2) -> Path:
    """The folder holding llama-server and llama-batched-bench, built once."""
    src, out = source_dir(), build_dir()
    bins = out / "bin"
    if all((bins / t).exists() for t in TARGETS):
        return bins
    if shutil.which("cmake") is None:
        raise SystemExit("cmake not found: apt-get install cmake (or pip install cmake)")
    subprocess.run(
        ["cmake", "-S", str(src), "-B", str(out), "-DCMAKE_BUILD_TYPE=Release",
         "-DGGML_NATIVE=ON", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF",
         "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DBUILD_SHARED_LIBS=OFF"],
        check=True,
    )  # fmt: skip
    subprocess.run(
        ["cmake", "--build", str(out), "--config", "Release", f"-j{jobs}", "--target", *TARGETS],
        check=True,
    )
    return bins


def _split(name: str, text: str) -> list[str]:
    """llama.cpp pre-tokenizer `name`'s pieces of `text`, in ByteLevel form as HF shows them."""
    import regex
    import tokenizers

    if name == "refact":  # `\p{N}` first, then GPT-2's regex on each part
        parts = regex.split(r"(\p{N})", text)
        pieces = [x for part in parts for x in regex.findall(GPT2_REGEX, part)]
    elif name == "qwen2":
        pieces = regex.findall(QWEN2_REGEX, text)
    else:
        raise ValueError(f"no reference split for llama.cpp pre-tokenizer {name!r}")
    bl = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return [p for piece in pieces for p, _ in bl.pre_tokenize_str(piece)]


PRE_TOKENIZERS = ("refact", "qwen2")


@functools.cache
def pre_tokenizer(model_dir: str) -> str:
    """The llama.cpp pre-tokenizer whose split equals, on every sample, the split of the HF
    tokenizer as transformers.AutoTokenizer loads it for this model (what loom and the HF
    baselines tokenize with; for a Qwen2 config it is Qwen2's regex, not tokenizer.json's)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    pre = tok.backend_tokenizer.pre_tokenizer
    hf = [[piece for piece, _ in pre.pre_tokenize_str(t)] for t in SAMPLES]
    for name in PRE_TOKENIZERS:
        if all(_split(name, t) == h for t, h in zip(SAMPLES, hf, strict=True)):
            print(
                f"pre-tokenizer: {type(tok).__name__}'s split equals llama.cpp's {name!r} "
                f"on {len(SAMPLES)} samples"
            )
            return name
    raise SystemExit(
        f"{model_dir}: the HF pre-tokenizer ({pre}) splits the samples like none of llama.cpp's "
        f"{PRE_TOKENIZERS}"
    )


def convert(model: str) -> Path:
    """The GGUF of a benchmark model, at the model's own dtype, with the llama.cpp
    pre-tokenizer that splits as the model's HF tokenizer does."""
    label, path = common.resolve_model(model)
    cfg = json.loads(Path(path, "config.json").read_text())
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    outtype = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[dtype]
    pre = pre_tokenizer(path)
    out = CACHE / "gguf" / f"{label}-{outtype}-{pre}.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    src = source_dir()
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); sys.argv = sys.argv[2:]\n"
        "import convert_hf_to_gguf as c\n"
        "from conversion.base import TextModel\n"
        # the converter hashes the whole vocabulary's tokenization; ours is in no table
        f"TextModel.get_vocab_base_pre = lambda self, tokenizer: {pre!r}\n"
        "orig_sp = TextModel._create_vocab_sentencepiece\n"
        "def sp(self):\n"  # no tokenizer.model: the BPE path, without importing sentencepiece
        "    if not (self.dir_model / 'tokenizer.model').is_file():\n"
        "        raise FileNotFoundError(self.dir_model / 'tokenizer.model')\n"
        "    return orig_sp(self)\n"
        "TextModel._create_vocab_sentencepiece = sp\n"
        "c.main()\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code, str(src), "convert_hf_to_gguf.py", path,
         "--outfile", str(out) + ".tmp", "--outtype", outtype],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    (CACHE / "convert.log").write_text(res.stdout + res.stderr)
    if res.returncode != 0:
        raise SystemExit(f"convert_hf_to_gguf.py failed:\n{res.stderr[-3000:]}")
    os.replace(str(out) + ".tmp", out)
    print(f"converted {label} to {out} (log: {CACHE / 'convert.log'})")
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_post = common.post_json


@contextmanager
def server(
    gguf: Path,
    *,
    parallel: int,
    ctx: int,
    threads: int,
    fa: str = "auto",
    kv: str = "f16",
    kv_unified: bool = False,
    log_name: str = "server.log",
):
    """A running llama-server; yields its base URL. kv: the KV cache type (llama.cpp's default,
    f16, is what the benchmarks time, and the token check runs on it too). kv_unified: one KV
    pool shared by the slots (--kv-unified) instead of llama.cpp's default of ctx / parallel
    per slot. Its log goes to CACHE/log_name."""
    port = _free_port()
    cmd = [
        str(build() / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
        "-np", str(parallel), "-c", str(ctx), "-t", str(threads), "-tb", str(threads),
        "-fa", fa, "-cram", "0", "--no-webui", "-b", "2048", "-ub", "512", "-ctk", kv, "-ctv", kv,
    ] + (["--kv-unified"] if kv_unified else [])  # fmt: skip
    log = open(CACHE / log_name, "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"llama-server exited {proc.returncode}; see {CACHE / log_name}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline:
                raise SystemExit("llama-server did not become healthy in 300 s")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def completion_body(ids: list[int], n: int, ignore_eos: bool = True) -> dict:
    return {"prompt": ids, "n_predict": n, "temperature": 0, "ignore_eos": ignore_eos,
            "cache_prompt": False, "return_tokens": True}  # fmt: skip


def complete(url: str, ids: list[int], n: int, ignore_eos: bool = True) -> dict:
    return _post(url + "/completion", completion_body(ids, n, ignore_eos))


# A greedy token may differ where loom's top two candidates are this close in logprob: the
# sides keep KV in different precisions (loom f32, llama.cpp's timed f16), which moves near
# ties and nothing else. Any other difference fails the check.
NEAR_TIE = 0.05


def check(
    model: str, threads: int, kv: str = "f16", fas: tuple[str, ...] = ("auto", "off")
) -> None:
    """Tokenization against the HF tokenizer, then greedy tokens against loom's, on the
    llama-server settings the benchmarks time (KV type `kv`, each -fa in `fas`). Raises
    SystemExit on a tokenization difference, or on a greedy difference that is not at a near
    tie of loom's logprobs (NEAR_TIE); prints what it compared."""
    import transformers

    import loom

    label, path = common.resolve_model(model)
    gguf = convert(model)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    prompts = [tok.encode(t) for t in SAMPLES]
    theirs: dict[str, list[list[int]]] = {}
    for fa in fas:
        with server(gguf, parallel=1, ctx=1024, threads=threads, kv=kv, fa=fa) as url:
            if not theirs:
                for text, ids in zip(SAMPLES, prompts, strict=True):
                    got = _post(
                        url + "/tokenize",
                        {"content": text, "add_special": False, "parse_special": True},
                    )
                    if got["tokens"] != ids:
                        raise SystemExit(
                            f"tokenization differs on {text!r}:\nHF    {ids}\nllama {got['tokens']}"
                        )
                print(
                    f"tokenization: llama-server equals the HF tokenizer on {len(SAMPLES)} samples"
                )
            # EOS allowed on both sides: llama.cpp's ignore_eos removes end-of-generation tokens
            # from sampling, while loom's (SGLang's) only keeps going after one
            theirs[fa] = [complete(url, ids, 16, ignore_eos=False)["tokens"] for ids in prompts]
    engine = loom.Engine(path, random_seed=0, cpu_threads=threads)
    try:
        outs = engine.generate(
            input_ids=prompts,
            sampling_params={"max_new_tokens": 16, "temperature": 0},
            return_logprob=True,
            top_logprobs_num=2,
        )
    finally:
        engine.shutdown()
    eos = set(tok.all_special_ids)  # a stop token is reported by one side and not the other
    bad = []
    for fa, lists in theirs.items():
        ties = []
        for k, (o, ts) in enumerate(zip(outs, lists, strict=True)):
            ours = [t for t in o["output_ids"] if t not in eos]
            ts = [t for t in ts if t not in eos]
            at = next((i for i, (x, y) in enumerate(zip(ours, ts)) if x != y), None)
            if at is None:
                if len(ours) != len(ts) and min(len(ours), len(ts)) < 16:
                    bad.append(f"-fa {fa} prompt {k}: {len(ours)} vs {len(ts)} tokens (EOS)")
                continue
            top = o["meta_info"]["output_top_logprobs"][at]
            gap = top[0][0] - top[1][0] if len(top) > 1 else float("inf")
            if gap < NEAR_TIE:
                ties.append(f"prompt {k} at token {at} (gap {gap:.3f})")
            else:
                bad.append(f"-fa {fa} prompt {k}: token {at} is {ts[at]}, loom's {ours[at]} "
                           f"(loom's top-2 gap {gap:.3f} >= {NEAR_TIE})")  # fmt: skip
        print(
            f"greedy tokens ({label}, llama-server KV {kv}, -fa {fa}): "
            f"{len(prompts) - len(ties)}/{len(prompts)} prompts identical (16 tokens or EOS)"
            + (f"; near ties: {', '.join(ties)}" if ties else "")
        )
    if bad:
        raise SystemExit("greedy tokens differ from loom's:\n" + "\n".join(bad))


class ServerPeer:
    """llama-server as one side of bench_offline's alternating runs: started once for a request
    set (-np = the number of requests; per-slot KV, or one unified pool with kv_unified, sized
    for all of them; token-id prompts, cache_prompt off, the given thread count), warmed up,
    and kept up across rounds."""

    def __init__(
        self,
        model: str,
        threads: int,
        fa: str,
        reqs: list[tuple[list[int], int]],
        kv_unified: bool = False,
    ):
        gguf = convert(model)
        if kv_unified:  # one pool: room for every request's tokens
            ctx = sum(len(p) + m for p, m in reqs) + 64 * len(reqs)
        else:  # llama.cpp's default: ctx / parallel per slot, so each slot fits the longest
            ctx = len(reqs) * (max(len(p) + m for p, m in reqs) + 64)
        self._stack = ExitStack()
        self.url = self._stack.enter_context(
            server(
                gguf,
                parallel=len(reqs),
                ctx=ctx,
                threads=threads,
                fa=fa,
                kv_unified=kv_unified,
                log_name=f"server-fa-{fa}{'-unified' if kv_unified else ''}.log",
            )
        )
        complete(self.url, reqs[0][0], 4)  # warm-up, as loom and HF get

    def run(self, reqs: list[tuple[list[int], int]]) -> float:
        """Seconds for all requests sent at once, each on its own connection (common.post_all,
        the client bench_offline's loom server side uses too)."""
        elapsed, outs = common.post_all(
            self.url + "/completion", [completion_body(p, m) for p, m in reqs]
        )
        useful = sum(len(o["tokens"]) for o in outs)
        assert useful == sum(m for _, m in reqs), (useful, sum(m for _, m in reqs))
        return elapsed

    def close(self) -> None:
        self._stack.close()


def offline(
    model: str,
    threads: int,
    num_requests: int,
    seed: int,
    fa: str,
    max_prompt: int = 400,
    max_new: int = 128,
) -> float:
    """Useful tok/s of llama-server on bench_offline's requests, all sent at once (one run;
    bench_offline alternates it with loom and HF when run_all passes it as a peer)."""
    import transformers
    from bench_offline import make_requests

    _, path = common.resolve_model(model)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    reqs = make_requests(tok, num_requests, seed, max_prompt, max_new)
    side = ServerPeer(model, threads, fa, reqs)
    try:
        return sum(m for _, m in reqs) / side.run(reqs)
    finally:
        side.close()


def batched(model: str, threads: int, pp: int, tg: int, batches: list[int], fa: str) -> list[dict]:
    """llama-batched-bench rows: {pl, speed_pp, speed_tg, ...} per batch size."""
    gguf = convert(model)
    ctx = max(batches) * (pp + tg) + 64
    cmd = [
        str(build() / "llama-batched-bench"), "-m", str(gguf), "-c", str(ctx), "-b", "2048",
        "-ub", "512", "-npp", str(pp), "-ntg", str(tg), "-npl", ",".join(map(str, batches)),
        "-t", str(threads), "-tb", str(threads), "-fa", fa, "--output-format", "jsonl",
    ]  # fmt: skip
    for _ in range(5):
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if res.returncode != 0:
            raise SystemExit(f"llama-batched-bench failed:\n{res.stderr[-2000:]}")
        lines = (res.stdout + "\n" + res.stderr).splitlines()  # LOG may go to either stream
        rows = [json.loads(line) for line in lines if line.startswith('{"n_kv_max"')]
        if len(rows) == len(batches):
            return rows
        # about one run in ten here exits 0 having printed nothing at all (stdout and stderr
        # empty, not even the model loader's lines); the same command then prints its rows
        print(f"llama-batched-bench printed {len(rows)} rows for {len(batches)} batch sizes; again")
    raise SystemExit(f"llama-batched-bench printed {len(rows)} rows for {len(batches)} batch sizes")


def gguf_batched(
    gguf: str, threads: int, pp: int, tg: int, batches: list[int], fa: str
) -> list[dict]:
    """llama-batched-bench rows on a given GGUF file (a real model's own file, e.g. SmolLM2's
    Q4_1: bench_real.py's peer); only llama-batched-bench needs to be built."""
    found = sorted(CACHE.glob("*/build/bin/llama-batched-bench"))
    tool = found[-1] if found else build() / "llama-batched-bench"
    ctx = max(batches) * (pp + tg) + 64
    cmd = [
        str(tool), "-m", str(gguf), "-c", str(ctx), "-b", "2048", "-ub", "512",
        "-npp", str(pp), "-ntg", str(tg), "-npl", ",".join(map(str, batches)),
        "-t", str(threads), "-tb", str(threads), "-fa", fa, "--output-format", "jsonl",
        # no weight repacking: its AMX buffer (Q4_1 tiles, -march=native on a CPU that lists
        # amx_int8) dies with SIGILL where the kernel grants no AMX state (this VM)
        "-nr",
    ]  # fmt: skip
    rows: list[dict] = []
    for _ in range(5):  # see batched(): a run now and then prints nothing
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if res.returncode != 0:
            raise SystemExit(f"llama-batched-bench failed:\n{res.stderr[-2000:]}")
        lines = (res.stdout + "\n" + res.stderr).splitlines()
        rows = [json.loads(line) for line in lines if line.startswith('{"n_kv_max"')]
        if len(rows) == len(batches):
            return rows
    raise SystemExit(f"llama-batched-bench printed {len(rows)} rows for {len(batches)} batch sizes")


def batched_point(
    model: str, threads: int, fa: str, b: int, pp: int, tg: int
) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of llama-batched-bench at one batch size: one side of
    bench_offline's per-batch-size alternation."""
    r = batched(model, threads, pp, tg, [b], fa)[0]
    return r["speed_pp"], r["speed_tg"]


_checked: set[tuple[str, int]] = set()


def peers(model: str, threads: int) -> dict:
    """llama.cpp's sides for bench_offline --llamacpp: llama-server for the offline workload and
    llama-batched-bench for the batch sweep, llama.cpp's default (-fa auto) and -fa off. Builds
    and converts once, and checks tokenization and greedy tokens first (once per process)."""
    build()
    if (model, threads) not in _checked:
        check(model, threads)
        _checked.add((model, threads))
    return {
        "offline": {
            f"llama.cpp -fa {fa}{' --kv-unified' if uni else ''}": (
                lambda reqs, fa=fa, uni=uni: ServerPeer(model, threads, fa, reqs, uni)
            )
            for fa in ("auto", "off")
            for uni in (False, True)
        },
        "batched": {
            f"llama.cpp -fa {fa}": (
                lambda b, pp, tg, fa=fa: batched_point(model, threads, fa, b, pp, tg)
            )
            for fa in ("auto", "off")
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "command", choices=["build", "convert", "check", "offline", "batched", "gguf", "all"]
    )
    p.add_argument("--gguf", default=None, help="gguf: the GGUF file llama-batched-bench runs")
    p.add_argument("--model", default="bundled", help=f"one of {common.MODELS} or a model folder")
    p.add_argument("--threads", type=int, default=1, help="threads for llama.cpp and loom")
    p.add_argument("--jobs", type=int, default=2, help="parallel compile jobs for the build")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-prompt", type=int, default=400, help="offline: prompt lengths 10..this")
    p.add_argument("--max-new", type=int, default=128, help="offline: new tokens 8..this")
    p.add_argument("--pp", type=int, default=128, help="batched: prompt tokens per sequence")
    p.add_argument("--tg", type=int, default=32, help="batched: generated tokens per sequence")
    p.add_argument("--batches", default="1,8,32,64")
    args = p.parse_args()
    print(common.header("llama.cpp peer"))
    if args.command in ("build", "all"):
        print(f"llama.cpp tools in {build(args.jobs)}")
    if args.command in ("convert", "all"):
        print(f"gguf {convert(args.model)}")
    if args.command in ("check", "all"):
        check(args.model, args.threads)
    if args.command in ("offline", "all"):
        for fa in ("auto", "off"):  # llama.cpp's default per-slot KV
            tps = offline(
                args.model,
                args.threads,
                args.num_requests,
                args.seed,
                fa,
                args.max_prompt,
                args.max_new,
            )
            print(f"llama-server -fa {fa:4}  {tps:9.1f} useful tok/s")
    if args.command in ("batched", "all"):
        batches = [int(b) for b in args.batches.split(",")]
        for fa in ("auto", "off"):
            for r in batched(args.model, args.threads, args.pp, args.tg, batches, fa):
                print(
                    f"llama-batched-bench -fa {fa:4} B={r['pl']:3} pp {args.pp} tg {args.tg}: "
                    f"prefill {r['speed_pp']:9.1f} tok/s  decode {r['speed_tg']:8.1f} tok/s"
                )
    if args.command == "gguf":
        batches = [int(b) for b in args.batches.split(",")]
        for fa in ("on", "off"):
            for r in gguf_batched(args.gguf, args.threads, args.pp, args.tg, batches, fa):
                print(
                    f"llama-batched-bench -fa {fa:3} B={r['pl']:3} pp {args.pp} tg {args.tg}: "
                    f"prefill {r['speed_pp']:9.1f} tok/s  decode {r['speed_tg']:8.1f} tok/s"
                )
    print(common.loadavg())


if __name__ == "__main__":
    main()
