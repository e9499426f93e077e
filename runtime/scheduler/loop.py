"""The scheduler process: receive requests, step, send token outputs."""

from __future__ import annotations

import logging
import traceback

from loom.runtime.io_struct import BatchTokenIDOut, ToScheduler, decoder, encode

logger = logging.getLogger(__name__)


def run_scheduler_process(args, ipc, dist_addr, owner_pid, ready_pipe) -> None:
    """Rank 0 (the only scheduler): with world_size > 1 it also joins the process group and
    broadcasts each step to the other ranks (runtime/parallel_worker.py)."""
    import zmq

    from loom.runtime.channel import Sender
    from loom.runtime.process import configure_child_process, freeze_startup_heap
    from loom.runtime.runner_choice import choose
    from loom.runtime.scheduler.scheduler import Scheduler

    configure_child_process(args, "scheduler", owner_pid)
    try:
        torch_free = choose(args)  # ArrayRunner: no torch in this process (array_runner.py)
        if args.resolved_device == "cpu" and not torch_free:
            import torch

            # oversubscribed OpenMP threads spin against the other processes: 20x slower
            # decode steps were measured on a busy 2-core machine with 2 threads vs 1
            # (ArrayRunner passes the same count to each C forward call)
            torch.set_num_threads(args.effective_cpu_threads)
        if torch_free:
            sched = Scheduler(args)
            ranks = [sched.runner.rank_info(0)]
        elif args.world_size > 1:
            from loom.runtime.parallel_worker import BroadcastRunner, setup_rank

            runner, ranks = setup_rank(args, 0, dist_addr)
            sched = Scheduler(args, model_runner=BroadcastRunner(runner))
        else:
            from loom.runtime.parallel_worker import rank_info

            sched = Scheduler(args)
            ranks = [rank_info(sched.runner, 0)]
        extra_state = _parallel_state(args, ranks)
        ctx = zmq.Context()
        recv = ctx.socket(zmq.PULL)
        recv.bind(ipc.scheduler)
        send = Sender(ipc.detokenizer)  # outputs: runtime/channel.py
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
        ready_pipe.send({"error": f"scheduler failed to start: {e}"})
        logger.error(traceback.format_exc())
        raise SystemExit(1) from e
    sched.grammar_queue.wait_ready()  # healthy only once a grammar need not build them
    freeze_startup_heap()
    ready_pipe.send({"ok": True, **sched.get_state(), **extra_state(sched)})
    dec = decoder(ToScheduler)
    poller = zmq.Poller()
    poller.register(recv, zmq.POLLIN)
    while True:
        timeout = 1000 if sched.is_idle else (1 if sched.only_waiting_for_grammar else 0)
        while poller.poll(timeout):
            reply = sched.handle_message(dec.decode(recv.recv()))
            if reply is not None and reply.state is not None:
                reply.state.update(extra_state(sched))
            if reply is not None:
                send.send(encode(reply))
            timeout = 0
        outputs = sched.step()
        if outputs:
            send.send(encode(BatchTokenIDOut(outputs)))


def _expert_counts(sched) -> dict:
    """Tokens routed to each expert so far, per MoE layer: with several ranks each counts its
    own experts (and a pipeline stage its own layers), so every rank is asked."""
    from loom.runtime.array_runner import ArrayRunner

    runner, cfg = sched.runner, sched.runner.config
    if isinstance(runner, ArrayRunner):  # no MoE model there (and no torch to import)
        return {}
    from loom.runtime.layers.moe import expert_token_counts

    moe = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if moe and sched.args.world_size > 1:  # BroadcastRunner: gathered, summed
        counts = runner.expert_token_counts()
    else:
        counts = expert_token_counts(runner.model)
    return {"expert_token_counts": counts} if counts else {}


def _parallel_state(args, ranks: list[dict]):
    layout = {
        "world_size": args.world_size,
        "tp_size": args.tp_size,
        "ep_size": args.ep_size,
        "pp_size": args.pp_size,
        "nnodes": args.nnodes,
        "ranks": ranks,
    }
    return lambda sched: {"parallel": layout, **_expert_counts(sched)}
