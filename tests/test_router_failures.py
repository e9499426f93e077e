"""The router's failure paths against scripted workers (no model): a worker that drops a
request before answering, and one that cuts a stream it has started. The kill test in
test_router.py does this with real servers, where which requests a SIGKILL catches is timing;
here each path is taken on every run."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from loom.runtime.router.process import RouterProcess

EVENT = b'data: {"text": "Hel", "output_ids": [1]}\n\n'


class _Worker(BaseHTTPRequestHandler):
    """`server.broken` False: /health 200, /generate answers (streamed or not) from this
    worker. True: /health 503, a plain /generate is dropped before any answer, a stream sends
    one event and then the connection is cut."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        status = 503 if self.server.broken else 200
        self._answer(status, b"down\n" if self.server.broken else b"OK\n", "text/plain")

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append(body["text"])
        if self.server.broken and not body.get("stream"):
            self.connection.shutdown(socket.SHUT_RDWR)  # dropped: no byte of an answer
            self.close_connection = True
            return
        if body.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self._chunk(EVENT)
            if self.server.broken:
                time.sleep(0.2)  # the client has the first event; then the worker is gone
                self.connection.shutdown(socket.SHUT_RDWR)
                self.close_connection = True
                return
            self._chunk(b"data: [DONE]\n\n")
            self._chunk(b"")
            return
        answer = json.dumps({"text": body["text"], "worker": self.server.name}).encode()
        self._answer(200, answer, "application/json")

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _answer(self, status: int, data: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def fake_workers():
    servers = []
    for name, broken in (("good", False), ("broken", True)):
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Worker)
        server.daemon_threads = True
        server.name, server.broken, server.seen = name, broken, []
        server.url = f"http://127.0.0.1:{server.server_address[1]}"
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    yield servers
    for server in servers:
        server.shutdown()
        server.server_close()


def _router(*urls: str) -> RouterProcess:
    # health checks far apart: only the probe that follows a failed request removes a worker
    return RouterProcess(list(urls), "--policy", "round_robin", "--health-check-interval", "600")


def test_requests_dropped_by_a_worker_complete_elsewhere_and_it_is_removed(fake_workers):
    good, broken = fake_workers
    with _router(broken.url, good.url) as router:
        texts = [f"q{i}" for i in range(6)]
        with ThreadPoolExecutor(len(texts)) as pool:
            results = list(pool.map(lambda t: router.post("/generate", {"text": t}), texts))
        for text, res in zip(texts, results):  # every one answered, by the good worker
            assert res.status_code == 200, res.text
            assert res.json() == {"text": text, "worker": "good"}
        assert broken.seen, "round robin never tried the broken worker"
        assert sorted(good.seen) == texts  # each retried request ran once there
        deadline = time.monotonic() + 30  # the probe after the failure runs in the background
        while broken.url not in [w["url"] for w in router.get("/list_workers").json()["removed"]]:
            assert time.monotonic() < deadline, router.get("/list_workers").json()
            time.sleep(0.05)
        listing = router.get("/list_workers").json()
        assert listing["urls"] == [good.url]
        reason = listing["removed"][0]["removed_reason"]
        assert reason.startswith("request failed: ") and "/health answered 503" in reason, reason
        metrics = router.get("/metrics").text
        retries = next(ln for ln in metrics.splitlines() if ln.startswith("loom_router_retries"))
        assert int(float(retries.split()[-1])) == len(broken.seen)
        assert f'loom_router_worker_healthy{{worker="{broken.url}"}} 0' in metrics


def test_a_started_stream_cut_by_its_worker_ends_with_an_error_naming_it(fake_workers):
    good, broken = fake_workers
    with _router(broken.url, good.url) as router:
        with router.post("/generate", {"text": "s", "stream": True}, stream=True) as res:
            assert res.status_code == 200
            lines = [ln for ln in res.iter_lines() if ln]
        assert broken.seen == ["s"] and good.seen == []  # not moved: it had started
        assert lines[0] == EVENT.strip()
        error = json.loads(lines[1][len(b"data: ") :])["error"]
        assert error["code"] == 502
        assert error["message"].startswith(f"worker {broken.url} failed mid-stream")
        assert error["message"].endswith("request not finished")
        assert lines[2:] == [b"data: [DONE]"]
        # the next stream goes to the good worker and passes through whole
        with router.post("/generate", {"text": "t", "stream": True}, stream=True) as res:
            assert [ln for ln in res.iter_lines() if ln] == [EVENT.strip(), b"data: [DONE]"]
        assert good.seen == ["t"]
