"""transformers' own GGUF loading (float32) as the reference of tests/test_gguf_real.py's greedy
parity test, computed in a background process that tests/conftest.py starts when the session's
collection holds that test.

The reference is the same as when the test computed it itself: transformers' tokenizer and
model from the GGUF file, `generate` greedy on each prompt alone, its logits' top-2 gap kept at
every position (the test's near-tie rule). What moves is where and when: gguf-py's Python parse
of the file's metadata and its numpy dequantize (single-threaded, ~60 s of CPU for Gemma 3's
262k-entry vocabulary, ~45 s for SmolLM2 with its 16 generates) run beside the suite's first
tests, which mostly wait on servers and leave a core idle on the 2-core CI machine, instead of
inside the test. The test checks the prompts it builds with loom's tokenizer equal those the
reference generated from, and fails with this process's output if it failed.

`python -m tests.gguf_reference OUT_DIR NAME:N_PROMPTS:NEW_TOKENS ...` writes OUT_DIR/NAME.json
per case, in the order given (renamed into place when complete).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 times 7?",
    "Translate 'good morning' into Spanish.",
    "Give me a synonym for 'happy'.",
    "Why is the sky blue? Answer in one sentence.",
    "List two planets of the solar system.",
    "What does a bee make?",
    "Complete the sentence: The quick brown fox",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?",
    'Extract the name as JSON: "Maria is 34 and lives in Lisbon."',
    "Say hello in French.",
    "What is the opposite of cold?",
    "How many legs does a spider have?",
]
TEXTS = [
    "Hello world",
    " 123 4567 x1y2 3.14159",
    "  two  spaces\n\nnew\tlines  ",
    "héllo wörld — “quotes” 你好 😀",
    '{"name": "Maria", "age": 34, "city": "Lisbon"}',
    "<|im_start|>user\nhi<|im_end|>\n<start_of_turn>model\nok<end_of_turn>",
    "def f(x):\n    return x**2  # don't, I'll, we've",
]


def chat_prompts(tok, n_prompts: int) -> list[list[int]]:
    """The first n_prompts QUESTIONS as one-turn chats, by loom's tokenizer `tok`."""
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        for q in QUESTIONS[:n_prompts]
    ]
    return [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts]


def hf_gguf(path: str, what: str):
    import torch
    import transformers

    p = Path(path)
    if what == "tokenizer":
        return transformers.AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(p.parent), gguf_file=p.name, dtype=torch.float32
    )
    model.generation_config.eos_token_id = None
    return model.eval()


def reference(name: str, n_prompts: int, new_tokens: int) -> dict:
    """transformers' token ids of TEXTS, the prompts (loom's chat template), and per prompt its
    greedy continuation with the top-2 logit gap at each generated position."""
    import gguf
    import torch

    from loom.runtime.gguf.named import resolve_model_name
    from loom.runtime.tokenizer import load_tokenizer

    # transformers builds a new gguf.GGUFReader for the tokenizer, the config and the weights
    # of one file, and each parses the whole metadata in Python (Gemma's 262k-entry vocabulary:
    # ~25 s a parse on an idle core). The reader only reads, so one per file serves all three.
    reader = gguf.GGUFReader
    gguf.GGUFReader = functools.lru_cache(maxsize=2)(reader)
    try:
        path = resolve_model_name(name)
        ref_tok = hf_gguf(path, "tokenizer")
        texts = [ref_tok(text).input_ids for text in TEXTS]
        prompts = chat_prompts(load_tokenizer(path), n_prompts)
        model = hf_gguf(path, "model")
    finally:
        gguf.GGUFReader = reader
    want, gaps = [], []
    for ids in prompts:
        inp = torch.tensor([ids])
        with torch.no_grad():
            out = model.generate(
                inp, attention_mask=torch.ones_like(inp), max_new_tokens=new_tokens,
                do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
            )  # fmt: skip
        want.append(out.sequences[0, len(ids) :].tolist())
        top2 = [lg[0].float().topk(2).values for lg in out.logits]
        gaps.append([float(v[0] - v[1]) for v in top2])
    return {"texts": texts, "prompts": prompts, "want": want, "gaps": gaps}


class Background:
    """The reference process of one session: start(cases) spawns it, get(...) waits for one
    case's file (a failed process fails the test with its output), stop() ends it."""

    def __init__(self, out_dir: Path):
        self.out_dir = out_dir
        self.log = out_dir / "log.txt"
        self.proc: subprocess.Popen | None = None
        self.cases: set[tuple[str, int, int]] = set()

    def start(self, cases: list[tuple[str, int, int]]) -> None:
        self.cases = set(cases)
        args = [f"{n}:{p}:{t}" for n, p, t in cases]
        root = Path(__file__).resolve().parents[1]
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.gguf_reference", str(self.out_dir), *args],
                cwd=root, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )  # fmt: skip

    def get(self, name: str, n_prompts: int, new_tokens: int) -> dict:
        if (name, n_prompts, new_tokens) not in self.cases or self.proc is None:
            return reference(name, n_prompts, new_tokens)  # not started for it: compute here
        done = self.out_dir / f"{name}.json"
        if not done.exists() and self.proc.poll() is None:
            # a test waits on it now: back to the default priority, or on a machine others
            # load it gets no time (nice 19 against their processes: ~1.5 % of a core)
            try:
                os.setpriority(os.PRIO_PROCESS, self.proc.pid, 0)
            except OSError:  # lowering a nice value needs CAP_SYS_NICE: it stays niced
                pass
        while not done.exists():
            if self.proc.poll() is not None and not done.exists():
                raise AssertionError(
                    f"the reference process exited {self.proc.returncode}:\n"
                    + self.log.read_text()[-6000:]
                )
            time.sleep(0.05)
        return json.loads(done.read_text())

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()


def main(argv: list[str]) -> None:
    import torch

    # the suite's own tests run beside this process: one thread at the lowest priority takes
    # an idle core's time only, until a test waits for it (Background.get renices it)
    torch.set_num_threads(1)
    os.nice(19)
    out_dir = Path(argv[0])
    for case in argv[1:]:
        name, n_prompts, new_tokens = case.split(":")
        t0 = time.process_time()
        ref = reference(name, int(n_prompts), int(new_tokens))
        tmp = out_dir / f"{name}.json.tmp"
        tmp.write_text(json.dumps(ref))
        tmp.rename(out_dir / f"{name}.json")
        print(f"{name}: reference in {time.process_time() - t0:.1f} s of CPU", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
