"""Runtime: the HTTP server as a managed subprocess (`python -m loom.launch_server`)."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

from loom.runtime.server_args import API_KEY_ENV, ServerArgs

_LOG_TAIL = 4000


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def server_argv(args: ServerArgs) -> list[str]:
    """The command-line flags that reproduce `args` (defaults left out)."""
    import dataclasses

    argv: list[str] = []
    for f in dataclasses.fields(ServerArgs):
        if f.name in ("extra", "api_key"):  # the key travels by environment, not in `ps`
            continue
        value = getattr(args, f.name)
        if value is None or value == f.default:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            if value:
                argv.append(flag)
        else:
            argv += [flag, str(value)]
    return argv


def wait_for_health(url: str, process: subprocess.Popen, timeout: float) -> str:
    """Poll `url`/health: "healthy" once it answers 200, "exited" if `process` ends first,
    "timeout" after `timeout` seconds."""
    import requests

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return "exited"
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return "healthy"
        except requests.RequestException:
            pass
        time.sleep(0.05)  # a refused connect costs ~2 ms: a start is seen within 50 ms
    return "timeout"


class Runtime:
    """`Runtime(model_path=None, **server_args)`: start a server on a free port and wait
    until /health answers. `.url`, `.generate(...)`, `.shutdown()`; a context manager.
    The server's output goes to `.log_path`, which a clean shutdown (exit code 0) deletes
    unless `keep_log`; a server that failed keeps its log for whoever investigates."""

    def __init__(
        self,
        model_path: str | None = None,
        timeout: float = 600.0,
        keep_log: bool = False,
        **kwargs: Any,
    ):
        self.keep_log = keep_log
        kwargs.setdefault("port", free_port(kwargs.get("host", "127.0.0.1")))
        self.server_args = ServerArgs.from_kwargs(model_path=model_path, **kwargs)
        self.url = f"http://{self.server_args.host}:{self.server_args.port}"
        self._log = tempfile.NamedTemporaryFile(prefix="loom-server-", suffix=".log", delete=False)
        self.log_path = self._log.name
        cmd = [sys.executable, "-m", "loom.launch_server", *server_argv(self.server_args)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop(API_KEY_ENV, None)
        if self.server_args.api_key:
            env[API_KEY_ENV] = self.server_args.api_key
        self.process = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        atexit.register(self.shutdown)
        try:
            self._wait_healthy(timeout)
        except BaseException:
            self.shutdown()
            raise

    @property
    def pid(self) -> int:
        return self.process.pid

    def _headers(self) -> dict:
        key = self.server_args.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _wait_healthy(self, timeout: float) -> None:
        status = wait_for_health(self.url, self.process, timeout)
        if status == "exited":
            raise RuntimeError(
                f"the server exited during start-up (code {self.process.returncode}):\n{self.log_tail()}"
            )
        if status == "timeout":
            raise TimeoutError(
                f"the server did not become healthy in {timeout}s:\n{self.log_tail()}"
            )

    def log_tail(self, chars: int = _LOG_TAIL) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-chars:]
        except OSError:
            return ""

    # ------------------------------------------------------------------ requests
    def generate(
        self, prompt: str | list[str], sampling_params: dict | None = None, **kwargs: Any
    ) -> dict | list[dict]:
        import requests

        body = {"text": prompt, "sampling_params": sampling_params or {}, **kwargs}
        res = requests.post(self.url + "/generate", json=body, headers=self._headers())
        res.raise_for_status()
        return res.json()

    def get_server_info(self) -> dict:
        import requests

        res = requests.get(self.url + "/server_info", headers=self._headers())
        res.raise_for_status()
        return res.json()

    def flush_cache(self) -> bool:
        import requests

        return requests.post(self.url + "/flush_cache", headers=self._headers()).status_code == 200

    # ------------------------------------------------------------------ lifetime
    def shutdown(self, timeout: float = 20.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout`; returns the exit code."""
        proc = getattr(self, "process", None)
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        if not self._log.closed:
            self._log.close()
            if proc.returncode == 0 and not self.keep_log:
                with contextlib.suppress(OSError):
                    os.unlink(self.log_path)
        return proc.returncode

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
