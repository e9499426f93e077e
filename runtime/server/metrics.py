"""Prometheus metrics (`--enable-metrics`): counters and latency histograms fed by the
TokenizerManager's output hook; queue gauges and the cache hit rate read from the scheduler
on each scrape. One registry per server, so several servers can live in one process."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import Response

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip

router = APIRouter()


class Metrics:
    def __init__(self, model_name: str):
        from prometheus_client import (
            CollectorRegistry,
            Counter,
            Gauge,
            Histogram,
            disable_created_metrics,
        )

        disable_created_metrics()

        self.registry = reg = CollectorRegistry()
        labels = ["model_name"]
        self.labels = {"model_name": model_name}

        def lab(metric):
            return metric.labels(**self.labels)

        self.requests = lab(Counter("loom:num_requests", "Finished requests", labels, registry=reg))
        self.prompt_tokens = lab(
            Counter(
                "loom:prompt_tokens", "Prompt tokens of finished requests", labels, registry=reg
            )
        )
        self.generation_tokens = lab(
            Counter("loom:generation_tokens", "Generated tokens", labels, registry=reg)
        )
        self.cached_tokens = lab(
            Counter(
                "loom:cached_tokens",
                "Prompt tokens served by the prefix cache",
                labels,
                registry=reg,
            )
        )
        self.running = lab(Gauge("loom:num_running_reqs", "Running requests", labels, registry=reg))
        self.queued = lab(Gauge("loom:num_queue_reqs", "Waiting requests", labels, registry=reg))
        self.hit_rate = lab(
            Gauge(
                "loom:cache_hit_rate",
                "Prefix cache hit rate (cached / prompt tokens)",
                labels,
                registry=reg,
            )
        )
        self.kv_usage = lab(
            Gauge("loom:token_usage", "Fraction of KV slots in use or cached", labels, registry=reg)
        )
        self.ttft = lab(
            Histogram("loom:time_to_first_token_seconds", "Time to first token", labels,
                      buckets=_LATENCY_BUCKETS, registry=reg)
        )  # fmt: skip
        self.itl = lab(
            Histogram("loom:inter_token_latency_seconds", "Time between tokens", labels,
                      buckets=_LATENCY_BUCKETS, registry=reg)
        )  # fmt: skip
        self.e2e = lab(
            Histogram("loom:e2e_request_latency_seconds", "Request latency", labels,
                      buckets=_LATENCY_BUCKETS, registry=reg)
        )  # fmt: skip

        # parallel workers: tokens routed to each expert (the input to expert load balancing)
        self.expert_tokens = Gauge(
            "loom:moe_expert_tokens",
            "Tokens routed to each expert since start, per MoE layer",
            [*labels, "layer", "expert"],
            registry=reg,
        )

        # speculative decoding: totals since start, read from the scheduler's drafter stats
        self.spec_accept_length = lab(
            Gauge("loom:spec_accept_length", "Tokens per verify step (accepted drafts + the "
                  "sampled one)", labels, registry=reg)
        )  # fmt: skip
        self.spec_by_position = Gauge(
            "loom:spec_draft_tokens",
            "Draft tokens proposed / accepted at each draft position (1 = first) since start",
            [*labels, "position", "outcome"],
            registry=reg,
        )
        self.spec_accept_hist = Gauge(
            "loom:spec_verify_steps",
            "Verify steps by the number of draft tokens they accepted, since start",
            [*labels, "accepted"],
            registry=reg,
        )

        # hierarchical KV cache (radix/hicache.py): totals since start, read on each scrape
        self.hicache_hit_tokens = Gauge(
            "loom:hicache_hit_tokens", "Prompt tokens found per KV tier", [*labels, "tier"],
            registry=reg,
        )  # fmt: skip
        self.hicache_bytes = Gauge(
            "loom:hicache_bytes", "KV bytes moved per tier and direction",
            [*labels, "tier", "direction"], registry=reg,
        )  # fmt: skip
        self.hicache_load_seconds = lab(
            Gauge(
                "loom:hicache_load_seconds",
                "Seconds spent loading KV from L2/L3",
                labels,
                registry=reg,
            )  # fmt: skip
        )
        self.hicache_corrupt = lab(
            Gauge(
                "loom:hicache_corrupt_pages",
                "Stored pages rejected (recomputed)",
                labels,
                registry=reg,
            )  # fmt: skip
        )

    def on_output(self, state, num_new: int, now: float) -> None:
        """TokenizerManager hook: called for each output a request receives."""
        if num_new:
            self.generation_tokens.inc(num_new)
            # ReqState is an unhashable dataclass; the last token time rides on it.
            last = getattr(state, "_metrics_last_token", None)
            if last is None:
                self.ttft.observe(now - state.created)
            else:
                gap = (now - last) / num_new
                for _ in range(num_new):
                    self.itl.observe(gap)
            state._metrics_last_token = now
        if state.finished_reason is not None:
            self.requests.inc()
            self.prompt_tokens.inc(state.meta.get("prompt_tokens", len(state.msg.input_ids)))
            self.cached_tokens.inc(state.meta.get("cached_tokens", 0))
            self.e2e.observe(now - state.created)

    def update_from_scheduler(self, s: dict) -> None:
        self.running.set(s.get("num_running_reqs", 0))
        self.queued.set(s.get("num_waiting_reqs", 0))
        self.hit_rate.set(s.get("cache_hit_rate", 0.0))
        for layer, counts in (s.get("expert_token_counts") or {}).items():
            for expert, n in enumerate(counts):
                self.expert_tokens.labels(**self.labels, layer=layer, expert=str(expert)).set(n)
        total = s.get("max_total_tokens") or 0
        if total:
            self.kv_usage.set(1.0 - s.get("kv_available_tokens", total) / total)
        if "hicache_loads" in s:
            for tier in ("l1", "l2", "l3"):
                self.hicache_hit_tokens.labels(**self.labels, tier=tier).set(
                    s[f"hicache_{tier}_hit_tokens"]
                )
            for tier in ("l2", "l3"):
                for direction in ("read", "write"):
                    self.hicache_bytes.labels(**self.labels, tier=tier, direction=direction).set(
                        s[f"hicache_{tier}_{direction}_bytes"]
                    )
            self.hicache_load_seconds.set(s["hicache_load_seconds"])
            self.hicache_corrupt.set(s["hicache_corrupt_pages"])
        if "spec_accept_length" in s:
            self.spec_accept_length.set(s["spec_accept_length"])
            for outcome in ("proposed", "accepted"):
                for j, n in enumerate(s[f"spec_{outcome}_by_position"]):
                    self.spec_by_position.labels(
                        **self.labels, position=str(j + 1), outcome=outcome
                    ).set(n)
            for k, n in enumerate(s["spec_accept_len_hist"]):
                self.spec_accept_hist.labels(**self.labels, accepted=str(k)).set(n)


@router.get("/metrics")
async def metrics(request: Request):
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    state = request.app.state.server
    try:
        state.metrics.update_from_scheduler(
            await asyncio.wait_for(state.tm.get_internal_state(), 5.0)
        )
    except (asyncio.TimeoutError, RuntimeError):
        pass  # serve the last known gauges rather than fail the scrape
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
