"""RouterArgs: the configuration of `loom router` (flag names follow SGLang's router)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from loom.runtime.router.policy import POLICIES


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1]) == 0:
        raise ValueError(f"worker_urls: {url!r} is not an http:// or https:// URL")
    return url


@dataclass(frozen=True)
class RouterArgs:
    worker_urls: tuple[str, ...] = ()
    policy: str = "cache_aware"
    host: str = "127.0.0.1"
    port: int = 30000
    # cache_aware (policy.py)
    cache_threshold: float = 0.5
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.0001
    max_tree_size: int = 2**24
    # failure handling (workers.py)
    health_check_interval: float = 5.0
    health_failure_threshold: int = 3
    health_check_timeout: float = 5.0
    request_timeout: float = 1800.0
    api_key: str | None = None  # or LOOM_API_KEY; forwarded to the workers as it came
    log_level: str = "info"

    def __post_init__(self) -> None:
        object.__setattr__(self, "worker_urls", tuple(normalize_url(u) for u in self.worker_urls))
        self.validate()

    def validate(self) -> None:
        def need(cond: bool, name: str, what: str) -> None:
            if not cond:
                raise ValueError(f"{name}: {what}")

        need(self.policy in POLICIES, "policy", f"must be one of {POLICIES}, got {self.policy!r}")
        need(
            len(set(self.worker_urls)) == len(self.worker_urls),
            "worker_urls",
            f"lists a worker twice: {list(self.worker_urls)}",
        )
        need(
            0.0 <= self.cache_threshold <= 1.0,
            "cache_threshold",
            f"must be in [0, 1], got {self.cache_threshold}",
        )
        need(
            self.balance_abs_threshold >= 0,
            "balance_abs_threshold",
            f"must be >= 0, got {self.balance_abs_threshold}",
        )
        need(
            self.balance_rel_threshold >= 1.0,
            "balance_rel_threshold",
            f"must be >= 1, got {self.balance_rel_threshold}",
        )
        need(self.max_tree_size >= 1, "max_tree_size", f"must be >= 1, got {self.max_tree_size}")
        need(
            self.health_check_interval > 0,
            "health_check_interval",
            f"must be > 0, got {self.health_check_interval}",
        )
        need(
            self.health_failure_threshold >= 1,
            "health_failure_threshold",
            f"must be >= 1, got {self.health_failure_threshold}",
        )
        need(
            self.health_check_timeout > 0,
            "health_check_timeout",
            f"must be > 0, got {self.health_check_timeout}",
        )
        need(
            self.request_timeout > 0,
            "request_timeout",
            f"must be > 0, got {self.request_timeout}",
        )

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--worker-urls", nargs="*", default=[], help="loom (or SGLang) servers to route to"
        )
        parser.add_argument("--policy", choices=POLICIES, default="cache_aware")
        for f in dataclasses.fields(RouterArgs):
            if f.name in ("worker_urls", "policy"):
                continue
            kind = {"int": int, "float": float}.get(str(f.type).replace(" | None", ""), str)
            parser.add_argument(
                "--" + f.name.replace("_", "-"),
                type=kind,
                default=f.default,
                help=f"{_HELP[f.name]} (default: {f.default})",
            )
        # SGLang's PD flags: not built yet, refused by name rather than accepted and ignored
        for flag in ("--pd-disaggregation", "--prefill", "--decode"):
            parser.add_argument(flag, nargs="*", default=None, help=argparse.SUPPRESS)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> RouterArgs:
        import os

        from loom.runtime.server_args import API_KEY_ENV

        if ns.api_key is None:  # keeps the key out of `ps`
            ns.api_key = os.environ.get(API_KEY_ENV) or None
        for name in ("pd_disaggregation", "prefill", "decode"):
            if getattr(ns, name) is not None:
                raise ValueError(f"{name}: prefill/decode disaggregation is not supported yet")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(ns).items() if k in names})


_HELP = {
    "host": "HTTP bind address",
    "port": "HTTP port",
    "cache_threshold": "cache_aware: smallest matched fraction of a prompt that routes by prefix",
    "balance_abs_threshold": "cache_aware: route to the least loaded worker when max - min "
    "in-flight requests exceeds this (and the relative threshold)",
    "balance_rel_threshold": "cache_aware: ... and max exceeds this times min",
    "max_tree_size": "cache_aware: characters remembered per worker (least recently used first out)",
    "health_check_interval": "Seconds between /health probes of each worker",
    "health_failure_threshold": "Failed probes in a row that remove a worker",
    "health_check_timeout": "Seconds a /health probe may take",
    "request_timeout": "Seconds a request may take on a worker (504 beyond)",
    "api_key": "Require 'Authorization: Bearer <key>' on every route but /health and /metrics "
    "(or set LOOM_API_KEY); the header is passed on to the workers",
    "log_level": "Logging level",
}
