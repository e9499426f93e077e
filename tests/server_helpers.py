"""Helpers for tests that drive a live loom server over HTTP."""

from __future__ import annotations

import time

import requests


def server_info(url: str, timeout: float = 30.0) -> dict:
    return requests.get(url + "/server_info", timeout=timeout).json()


def wait_idle_and_intact(url: str, timeout: float = 20.0) -> dict:
    """Wait until nothing runs or waits and every KV slot is free or cached; returns the info."""
    deadline = time.monotonic() + timeout
    while True:
        info = server_info(url)
        idle = info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0
        intact = info["kv_available_tokens"] + info["cache_size_tokens"] == info["max_total_tokens"]
        if idle and intact:
            return info
        assert time.monotonic() < deadline, f"not idle/intact: {info}"
        time.sleep(0.2)
