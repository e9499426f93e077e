"""The router's Prometheus text: its own series per worker, and the workers' own series
merged with a `worker` label (families kept whole, as the text format requires)."""

from __future__ import annotations

from loom.runtime.router.policy import CacheAware


def _decisions(pool) -> dict:
    policy = pool.policy
    return {"decisions": dict(policy.decisions)} if isinstance(policy, CacheAware) else {}


def merge_worker_metrics(texts) -> str:
    """[(worker url, its /metrics text)] -> one exposition: each family's HELP/TYPE once,
    then every worker's samples of it, each with `worker="url"` added to its labels."""
    families: dict[str, dict] = {}
    for url, text in texts:
        family = None
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                name = line.split()[2]
                family = families.setdefault(name, {"meta": [], "samples": []})
                if line not in family["meta"]:
                    family["meta"].append(line)
            elif line and not line.startswith("#") and family is not None:
                family["samples"].append(_with_label(line, "worker", url))
    lines = []
    for family in families.values():
        lines += family["meta"] + family["samples"]
    return "\n".join(lines) + "\n" if lines else ""


def _with_label(sample: str, key: str, value: str) -> str:
    """`name{a="1"} v` -> `name{worker="u",a="1"} v`; `name v` -> `name{worker="u"} v`."""
    label = f'{key}="{value}"'
    brace, space = sample.find("{"), sample.find(" ")
    if brace != -1 and brace < space:
        head, rest = sample[:brace], sample[brace + 1 :]
        return f"{head}{{{label}{'' if rest.startswith('}') else ','}{rest}"
    return f"{sample[:space]}{{{label}}}{sample[space:]}"


def render_metrics(pool, metrics) -> str:
    """Prometheus text exposition: one series per worker (removed ones too)."""
    everyone = [*pool.workers.values(), *pool.removed.values()]
    lines = []

    def family(name: str, kind: str, help_text: str, values) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in values:
            label_text = ",".join(f'{k}="{v}"' for k, v in labels.items())
            lines.append(f"{name}{{{label_text}}} {value}" if labels else f"{name} {value}")

    family(
        "loom_router_requests_total",
        "counter",
        "Requests a worker served through this router",
        [({"worker": w.url}, w.requests) for w in everyone],
    )
    family(
        "loom_router_worker_failures_total",
        "counter",
        "Transport failures and 503s seen on a worker",
        [({"worker": w.url}, w.failures) for w in everyone],
    )
    family(
        "loom_router_in_flight_requests",
        "gauge",
        "Requests in flight on a worker",
        [({"worker": w.url}, w.in_flight) for w in everyone],
    )
    family(
        "loom_router_worker_healthy",
        "gauge",
        "1 while the worker is in the pool, 0 once removed",
        [({"worker": w.url}, int(w.removed_reason is None)) for w in everyone],
    )
    family(
        "loom_router_retries_total",
        "counter",
        "Requests moved to another worker",
        [({}, metrics.retries)],
    )
    decisions = _decisions(pool).get("decisions", {})
    family(
        "loom_router_cache_aware_decisions_total",
        "counter",
        "How the cache-aware policy chose",
        [({"kind": k}, v) for k, v in decisions.items()],
    )
    return "\n".join(lines) + "\n"
