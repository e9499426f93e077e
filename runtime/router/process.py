"""RouterProcess: `loom router` or sglang-router as a managed subprocess (tests, benchmarks,
scripts)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time

from loom.runtime.server.runtime_client import free_port

# How each router starts and when it is ready: `loom router` answers /list_workers once its
# workers are known; sglang-router's /health answers at once while it registers its workers in
# the background, so it is ready when /workers lists every one of them healthy.
_LAUNCH = {
    "loom": [sys.executable, "-m", "loom.cli", "router"],
    "sglang": [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--host",
        "127.0.0.1",
        "--shutdown-grace-period-secs",
        "1",
    ],
}


class RouterProcess:
    """`RouterProcess([url, ...], "--policy", "round_robin")`: start `loom router` (or, with
    `kind="sglang"`, SGLang's sglang-router from its wheel, same flags) on a free port and
    wait until it answers. `.url`, `.get/.post`, `.shutdown()`; a context manager."""

    def __init__(self, worker_urls, *flags: str, timeout: float = 300.0, kind: str = "loom"):
        import requests

        self.kind = kind
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile(
            prefix=f"{kind}-router-", suffix=".log", delete=False
        )
        cmd = [*_LAUNCH[kind], "--port", str(self.port)]
        if kind == "sglang":  # its metrics exporter binds a fixed port (29000) unless told
            cmd += ["--prometheus-port", str(free_port())]
        cmd += ["--worker-urls", *worker_urls, *flags]
        self.expected = len(worker_urls) + flags.count("--prefill") + flags.count("--decode")
        self.process = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the router exited during start-up:\n{self.log_tail()}")
            try:
                if self._ready(requests):
                    return
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                tail = self.log_tail()  # before shutdown, which deletes a clean exit's log
                self.shutdown()
                raise TimeoutError(f"the router did not start in {timeout}s:\n{tail}")
            time.sleep(0.2)

    def _ready(self, requests) -> bool:
        if self.kind == "loom":
            return requests.get(self.url + "/list_workers", timeout=2).status_code == 200
        res = requests.get(self.url + "/workers", timeout=2)
        workers = res.json().get("workers", []) if res.status_code == 200 else []
        return len(workers) == self.expected and all(w.get("is_healthy") for w in workers)

    def log_tail(self, chars: int = 3000) -> str:
        with open(self._log.name, errors="replace") as f:
            return f.read()[-chars:]

    def post(self, path: str, body, **kw):
        import requests

        return requests.post(self.url + path, json=body, timeout=kw.pop("timeout", 120), **kw)

    def get(self, path: str):
        import requests

        return requests.get(self.url + path, timeout=30)

    def shutdown(self, timeout: float = 20.0) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        if not self._log.closed:
            self._log.close()
            # uvicorn re-raises the SIGTERM it handled: -15 is a clean exit too; a router
            # that failed (or was killed) keeps its log
            if self.process.returncode in (0, -signal.SIGTERM):
                with contextlib.suppress(OSError):
                    os.unlink(self._log.name)

    def __enter__(self) -> RouterProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
