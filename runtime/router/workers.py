"""The router's workers: who is in, who was removed and why, and their health probes.

A worker leaves the pool when a request to it fails at the transport level (refused, reset,
closed mid-response) and a /health probe right after fails too, or when
`health_failure_threshold` probes in a row fail; it stays listed
under `removed` with the reason, and can come back through /add_worker.
Loads are the router's own count of requests in flight on each worker (no extra round trip).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from loom.runtime.router.args import normalize_url
from loom.runtime.router.policy import Policy

logger = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class Worker:
    url: str
    in_flight: int = 0
    requests: int = 0  # routed here (retries counted on the worker that served them)
    failures: int = 0  # transport failures and 503s seen here
    health_failures: int = 0  # consecutive failed probes
    removed_reason: str | None = None
    removed_at: float | None = None

    def summary(self) -> dict:
        out = {
            "url": self.url,
            "healthy": self.removed_reason is None,
            "in_flight": self.in_flight,
            "requests": self.requests,
            "failures": self.failures,
        }
        if self.removed_reason is not None:
            out["removed_reason"] = self.removed_reason
        return out


class WorkerPool:
    def __init__(self, policy: Policy, urls=()):
        self.policy = policy
        self.workers: dict[str, Worker] = {}
        self.removed: dict[str, Worker] = {}
        for url in urls:
            self.workers[url] = Worker(url)

    def healthy(self) -> list[Worker]:
        return list(self.workers.values())

    def pick(self, key: str | None, exclude: set[str]) -> Worker | None:
        candidates = [w for w in self.workers.values() if w.url not in exclude]
        if not candidates:
            return None
        return self.policy.select(candidates, key)

    def add(self, url: str) -> Worker:
        url = normalize_url(url)
        if url in self.workers:
            return self.workers[url]
        self.removed.pop(url, None)
        worker = self.workers[url] = Worker(url)
        logger.info("worker added: %s", url)
        return worker

    def remove(self, url: str, reason: str) -> Worker | None:
        worker = self.workers.pop(url, None)
        if worker is None:
            return None
        worker.removed_reason, worker.removed_at = reason, time.time()
        self.removed[url] = worker
        self.policy.remove_worker(url)
        logger.warning("worker removed: %s (%s)", url, reason)
        return worker

    def listing(self) -> dict:
        return {
            "urls": list(self.workers),
            "workers": [w.summary() for w in self.workers.values()],
            "removed": [w.summary() for w in self.removed.values()],
        }

    # ------------------------------------------------------------------ health
    async def probe(
        self, client, worker: Worker, timeout: float, threshold: int, cause: str | None = None
    ) -> bool:
        """GET /health; `threshold` failures in a row remove the worker, and so does one
        failure right after a failed request (`cause`): a request failing on a worker that
        still answers /health (a stale pooled connection, say) does not take it out."""
        try:
            res = await client.get(worker.url + "/health", timeout=timeout)
            ok, why = res.status_code == 200, f"/health answered {res.status_code}"
        except Exception as e:  # any transport failure is a failed probe
            ok, why = False, f"/health failed: {type(e).__name__}: {e}"
        if ok:
            worker.health_failures = 0
            return True
        worker.health_failures += 1
        if worker.url in self.workers and (cause or worker.health_failures >= threshold):
            reason = (
                f"{cause}; then {why}"
                if cause
                else f"{worker.health_failures} failed health checks ({why})"
            )
            self.remove(worker.url, reason)
        return False

    async def health_loop(self, client, interval: float, timeout: float, threshold: int):
        while True:
            await asyncio.sleep(interval)
            await asyncio.gather(
                *(self.probe(client, w, timeout, threshold) for w in self.healthy())
            )
