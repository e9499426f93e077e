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
    # prefill/decode disaggregation (pd.py): prefill workers as (url, bootstrap port or None:
    # read from the worker's /get_server_info), decode workers as urls
    pd_disaggregation: bool = False
    prefill: tuple[tuple[str, int | None], ...] = ()
    decode: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "worker_urls", tuple(normalize_url(u) for u in self.worker_urls))
        object.__setattr__(self, "prefill", tuple((normalize_url(u), p) for u, p in self.prefill))
        object.__setattr__(self, "decode", tuple(normalize_url(u) for u in self.decode))
        self.validate()

    @property
    def all_worker_urls(self) -> tuple[str, ...]:
        """Every worker: the plain ones, or the prefill then the decode ones."""
        if self.pd_disaggregation:
            return tuple(u for u, _ in self.prefill) + self.decode
        return self.worker_urls

    def validate(self) -> None:
        def need(cond: bool, name: str, what: str) -> None:
            if not cond:
                raise ValueError(f"{name}: {what}")

        need(self.policy in POLICIES, "policy", f"must be one of {POLICIES}, got {self.policy!r}")
        if self.pd_disaggregation:
            need(not self.worker_urls, "worker_urls", "use --prefill and --decode with PD")
            need(bool(self.prefill), "prefill", "--pd-disaggregation needs a prefill server")
            need(bool(self.decode), "decode", "--pd-disaggregation needs a decode server")
            urls = self.all_worker_urls
            need(len(set(urls)) == len(urls), "prefill", f"lists a server twice: {list(urls)}")
            for _, port in self.prefill:
                need(
                    port is None or 0 < port < 65536,
                    "prefill",
                    f"bootstrap port {port} is not a TCP port",
                )
        else:
            need(not self.prefill, "prefill", "needs --pd-disaggregation")
            need(not self.decode, "decode", "needs --pd-disaggregation")
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
        parser.add_argument(
            "--pd-disaggregation",
            action="store_true",
            help="Prefill/decode disaggregation: each request goes to a prefill server and a "
            "decode server (started with --disaggregation-mode prefill / decode), paired by "
            "bootstrap fields; the decode server's output is returned",
        )
        parser.add_argument(
            "--prefill",
            nargs="+",
            action="append",
            default=[],
            metavar="URL [BOOTSTRAP_PORT]",
            help="Prefill servers (repeat the flag, or list several URLs); a number after a URL "
            "is its --disaggregation-bootstrap-port, else the router reads it from the "
            "server's /get_server_info",
        )
        parser.add_argument(
            "--decode", nargs="+", action="append", default=[], help="Decode servers"
        )
        for f in dataclasses.fields(RouterArgs):
            if f.name in ("worker_urls", "policy", "pd_disaggregation", "prefill", "decode"):
                continue
            kind = {"int": int, "float": float}.get(str(f.type).replace(" | None", ""), str)
            parser.add_argument(
                "--" + f.name.replace("_", "-"),
                type=kind,
                default=f.default,
                help=f"{_HELP[f.name]} (default: {f.default})",
            )

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> RouterArgs:
        import os

        from loom.runtime.server_args import API_KEY_ENV

        if ns.api_key is None:  # keeps the key out of `ps`
            ns.api_key = os.environ.get(API_KEY_ENV) or None
        ns.prefill = _prefill_servers([x for group in ns.prefill for x in group])
        ns.decode = [x for group in ns.decode for x in group]
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(ns).items() if k in names})


def _prefill_servers(items: list[str]) -> list[tuple[str, int | None]]:
    """`URL [PORT] URL [PORT] ...` -> [(url, port or None)]."""
    out: list[tuple[str, int | None]] = []
    for item in items:
        if item.isdigit():
            if not out or out[-1][1] is not None:
                raise ValueError(f"prefill: bootstrap port {item} does not follow a URL")
            out[-1] = (out[-1][0], int(item))
        else:
            out.append((item, None))
    return out


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
