"""Prefill/decode disaggregation: a prefill server computes a prompt's KV and first token and
sends the KV to a decode server, which continues the request there (docs/architecture.md,
"Prefill/decode disaggregation"). The package holds `Side`, the type both sides share;
`factory.create_side` builds one (the sides import this package, so it imports none of them)."""


class Side:
    """What the prefill and the decode side both hold: the scheduler's KV owner and pool, its
    output processor, the transfer backend, the bound on every wait (seconds), and the
    transfer counters in the scheduler's stats."""

    def __init__(self, kv, kv_pool, output, transfer, timeout: float, stats: dict):
        self.kv = kv
        self.kv_pool = kv_pool
        self.output = output
        self.transfer = transfer
        self.timeout = timeout
        self.stats = stats
        stats.update(disagg_transfers=0, disagg_kv_tokens=0, disagg_kv_bytes=0)
