"""`create_side`: the scheduler's prefill or decode side of a disaggregated deployment,
imported lazily (nothing of disaggregation loads unless --disaggregation-mode asks)."""

from __future__ import annotations


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
