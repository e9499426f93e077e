"""The scheduler process: receive requests, step, send token outputs."""

from __future__ import annotations

import logging
import traceback

from loom.runtime.io_struct import BatchTokenIDOut, ToScheduler, decoder, encode

logger = logging.getLogger(__name__)


def run_scheduler_process(args, ipc, owner_pid, ready_pipe) -> None:
    import torch
    import zmq

    from loom.runtime.process import configure_child_process
    from loom.runtime.scheduler.scheduler import Scheduler

    configure_child_process(args, "scheduler", owner_pid)
    try:
        if args.resolved_device == "cpu":
            # oversubscribed OpenMP threads spin against the other processes: 20x slower
            # decode steps were measured on a busy 2-core machine with 2 threads vs 1
            torch.set_num_threads(args.effective_cpu_threads)
        sched = Scheduler(args)
        ctx = zmq.Context()
        recv = ctx.socket(zmq.PULL)
        recv.bind(ipc.scheduler)
        send = ctx.socket(zmq.PUSH)
        send.connect(ipc.detokenizer)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
        ready_pipe.send({"error": f"scheduler failed to start: {e}"})
        logger.error(traceback.format_exc())
        raise SystemExit(1) from e
    ready_pipe.send({"ok": True, **sched.get_state()})
    dec = decoder(ToScheduler)
    poller = zmq.Poller()
    poller.register(recv, zmq.POLLIN)
    while True:
        timeout = 1000 if sched.is_idle else (1 if sched.only_waiting_for_grammar else 0)
        while poller.poll(timeout):
            reply = sched.handle_message(dec.decode(recv.recv()))
            if reply is not None:
                send.send(encode(reply))
            timeout = 0
        outputs = sched.step()
        if outputs:
            send.send(encode(BatchTokenIDOut(outputs)))
