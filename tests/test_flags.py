"""Every flag and field is true: implemented, or refused by name (never accepted and ignored).
Refused server flags fail at start-up; refused /generate fields are a 400 when set to a value
loom cannot honour, and pass at their "off" value (SGLang's client sends some of them)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import requests

from loom.runtime.io_struct import decode_generate_request
from loom.runtime.sampling_params import make_sampling_params
from loom.runtime.server.runtime_client import Runtime
from loom.runtime.server_args import ServerArgs

REFUSED_FLAGS = [
    # tp/ep/nnodes/node_rank/dist_init_addr: test_parallel.py; dp_size: test_router.py
    ("trust_remote_code", True, "--trust-remote-code", None),
    ("attention_backend", "triton", "--attention-backend", "triton"),
]


@pytest.mark.parametrize("name, value, flag, arg", REFUSED_FLAGS, ids=[f[0] for f in REFUSED_FLAGS])
def test_unbuilt_flags_are_refused_at_start_up(name, value, flag, arg):
    with pytest.raises(ValueError, match=rf"^{name}: .*not supported yet"):
        ServerArgs(**{name: value})
    argv = [flag] if arg is None else [flag, arg]
    out = subprocess.run(
        [sys.executable, "-m", "loom.launch_server", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert f"{name}: " in out.stderr and "not supported yet" in out.stderr, out.stderr[-2000:]


REFUSED_FIELDS = {
    "lora_path": "/adapters/my-lora",
    "image_data": "https://example.com/cat.png",
    "custom_logit_processor": "{'callable': 'x'}",
    "modalities": ["image"],
    "bootstrap_pair_key": "10.0.0.2",
    "return_hidden_states": True,
    "session_params": {"id": "s"},
    "input_embeds": [[0.1, 0.2]],
    "lora_id": ["a", None],
}
OFF_VALUES = {
    "lora_path": None,
    "image_data": None,
    "custom_logit_processor": None,
    "modalities": [],
    "bootstrap_pair_key": [None, None],
    "return_hidden_states": False,
    "session_params": None,
}


def test_refused_fields_unit():
    for name, value in REFUSED_FIELDS.items():
        with pytest.raises(ValueError, match=rf"^{name}: not supported"):
            decode_generate_request({"text": "a", name: value})
    decode_generate_request({"text": "a", **OFF_VALUES})
    for name, value in {
        "beam_width": 4,
        "structural_tag": "{}",
        "watermark": {"k": 1},
        "custom_params": {"a": 1},
    }.items():
        with pytest.raises(ValueError, match=rf"^{name}: "):
            make_sampling_params({name: value})
    make_sampling_params({"beam_width": None, "structural_tag": None, "stop_regex": []})


def test_unknown_top_level_fields_are_ignored_with_a_warning(caplog):
    req = decode_generate_request({"text": "a", "no_such_field": 1})
    assert req.text == "a"
    assert "no_such_field" in caplog.text


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server  # conftest: one tiny-llama server shared by the modules that only read


@pytest.mark.parametrize("field", list(REFUSED_FIELDS)[:5])
def test_refused_generate_fields_are_400_naming_them(server, field):
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}
    res = requests.post(server.url + "/generate", json={**body, field: REFUSED_FIELDS[field]})
    assert res.status_code == 400, res.text
    assert res.json()["error"]["message"].startswith(f"{field}: not supported")
    res = requests.post(server.url + "/generate", json={**body, field: OFF_VALUES[field]})
    assert res.status_code == 200, res.text


def test_bootstrap_fields_are_refused_by_name_on_a_plain_server(server):
    """PD fields (set by `loom router --pd-disaggregation`) need --disaggregation-mode."""
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}, "bootstrap_room": 5}
    res = requests.post(server.url + "/generate", json=body)
    assert res.status_code == 400
    assert res.json()["error"]["message"].startswith("bootstrap_room: needs a server started")
    body = {"model": server.server_args.served_model_name, "prompt": "a", "bootstrap_port": 8998}
    res = requests.post(server.url + "/v1/completions", json=body)
    assert res.status_code == 400 and "bootstrap_port: needs a server started" in res.text


def test_sglang_sampling_params_at_their_defaults_pass(server):
    sp = {"max_new_tokens": 2, "stop_regex": [], "beam_width": None, "stop": ()}
    body = {"input_ids": [1, 2, 3], "sampling_params": sp, "lora_path": None}
    assert requests.post(server.url + "/generate", json=body).status_code == 200
    sp["stop_regex"] = "(unclosed"
    res = requests.post(server.url + "/generate", json=body)
    assert res.status_code == 400 and "stop_regex" in res.json()["error"]["message"]


# --------------------------------------------------------------------------- main guard
def test_engine_at_a_scripts_top_level_names_the_main_guard(tmp_path):
    script = tmp_path / "no_guard.py"
    script.write_text("import loom\n\nengine = loom.Engine()\n")
    start = time.monotonic()
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "RuntimeError" in out.stderr and 'if __name__ == "__main__":' in out.stderr
    assert "line 3" in out.stderr, out.stderr[-2000:]
    assert time.monotonic() - start < 60  # refused before any child starts


def test_main_guard_check_passes_guarded_and_function_calls(tmp_path):
    script = tmp_path / "guarded.py"
    script.write_text(
        textwrap.dedent(
            """
            from loom.runtime.process import check_main_guard

            def main():
                check_main_guard("x")

            if __name__ == "__main__":
                main()
                print("guarded ok")
            """
        )
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "guarded ok" in out.stdout, out.stderr
    bad = tmp_path / "bad.py"
    bad.write_text("from loom.runtime.process import check_main_guard\n\ncheck_main_guard('x')\n")
    out = subprocess.run([sys.executable, str(bad)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "__main__" in out.stderr


# --------------------------------------------------------------------------- watchdog
def test_watchdog_timeout_takes_a_stuck_runtime_down(tiny_model_dir):
    rt = Runtime(tiny_model_dir("llama"), max_total_tokens=1024, watchdog_timeout=2)
    sched = rt.get_server_info()["process_pids"]["scheduler"]
    try:
        os.kill(sched, signal.SIGSTOP)  # alive, but answers nothing
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}
        res = requests.post(rt.url + "/generate", json=body, timeout=60)
        assert res.status_code == 503 and "watchdog_timeout" in res.text, res.text
        assert rt.process.wait(30) == 1
    finally:
        try:
            os.kill(sched, signal.SIGKILL)
        except ProcessLookupError:
            pass
        rt.shutdown()
