"""Prefill/decode disaggregation: a prefill server computes a prompt's KV and first token and
sends the KV to a decode server, which continues the request there (docs/architecture.md,
"Prefill/decode disaggregation")."""


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


def create_side(args, kv, kv_pool, output, stats):
    """The scheduler's owner of disaggregated requests for --disaggregation-mode prefill or
    decode, over the transfer backend the flags name."""
    from loom.runtime.disagg.transfer import create_transfer

    transfer = create_transfer(args)
    if args.disaggregation_mode == "prefill":
        from loom.runtime.disagg.prefill import PrefillSide

        side = PrefillSide(kv, kv_pool, output, transfer, args.disaggregation_timeout, stats)
        output.hold_for_transfer = side.hold
        return side
    from loom.runtime.disagg.decode import DecodeSide

    return DecodeSide(kv, kv_pool, output, transfer, args.disaggregation_timeout, stats)
