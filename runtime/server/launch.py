"""launch_server: the HTTP process. It starts the scheduler and detokenizer processes (as the
Engine does), then serves the FastAPI app with uvicorn, the TokenizerManager living on
uvicorn's event loop.

Supervision: a dead child process makes /health answer 503 and the server exit with code 1
within seconds; SIGTERM or SIGINT stop it cleanly (exit 0) and take the children with it.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from pathlib import Path

from loom.runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)

_START_TIMEOUT = 600.0
# Seconds a dead runtime gets to send its 503s before os._exit(1): every pending request was
# failed the moment the death was seen, so there is nothing else to drain.
_FORCED_EXIT_AFTER = 3.0

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_BUILTIN_TEMPLATES = {"chatml": CHATML_TEMPLATE}


def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a .jinja/.json file, the template text itself, or a built-in name
    (`chatml`, or any name in runtime/chat_template.py's registry, turned into Jinja)."""
    if not value:
        return None
    if value in _BUILTIN_TEMPLATES:
        return _BUILTIN_TEMPLATES[value]
    path = Path(value)
    if path.is_file():
        text = path.read_text()
        if path.suffix == ".json":
            template = json.loads(text).get("chat_template")
            if not isinstance(template, str):
                raise ValueError(f"chat_template: {value} has no 'chat_template' string")
            return template
        return text
    if "{{" in value or "{%" in value:
        return value
    from loom.runtime.chat_template import get_chat_template

    try:
        return jinja_from_roles(get_chat_template(value))
    except ValueError:
        raise ValueError(
            f"chat_template: {value!r} is neither a file, a Jinja template nor a built-in name"
        ) from None


def jinja_from_roles(template) -> str:
    """A Jinja chat template from a registry template's role prefixes/suffixes."""
    roles = template.role_prefix_and_suffix
    parts = ["{% for message in messages %}"]
    for i, (role, (prefix, suffix)) in enumerate(roles.items()):
        keyword = "if" if i == 0 else "elif"
        parts.append(
            f"{{% {keyword} message['role'] == {json.dumps(role)} %}}"
            f"{{{{ {json.dumps(prefix)} + message['content'] + {json.dumps(suffix)} }}}}"
        )
    parts.append("{% else %}{{ message['content'] }}{% endif %}{% endfor %}")
    gen_prefix = roles.get("assistant", ("", ""))[0]
    parts.append(f"{{% if add_generation_prompt %}}{{{{ {json.dumps(gen_prefix)} }}}}{{% endif %}}")
    return "".join(parts)


def start_scheduler_ranks(args, ipc) -> list[tuple]:
    """Start this node's ranks: rank 0 (on node 0) is the scheduler and owns the ZMQ sockets,
    the others run the model on the steps it broadcasts. Returns (process, ready pipe) pairs,
    rank order."""
    from loom.runtime.process import start_process

    if args.distributed_executor_backend == "ray" and args.world_size > 1:
        from loom.runtime.ray_executor import rendezvous_addr, start_ray_ranks

        # rank 0 here (it owns the ZMQ sockets), ranks 1.. wherever Ray places them
        addr = rendezvous_addr(args)
        scheduler = start_process(_run_scheduler, (args, ipc, addr), "scheduler")
        return [scheduler, *((r, r) for r in start_ray_ranks(args, addr))]
    addr = args.dist_init_addr
    if addr is None and args.world_size > 1:
        from loom.runtime.distributed import free_local_addr  # torch: only for several ranks

        addr = free_local_addr()
    started = []
    for rank in args.node_ranks:
        if rank == 0:
            started.append(start_process(_run_scheduler, (args, ipc, addr), "scheduler"))
        else:
            target, name = _run_worker, f"scheduler-rank{rank}"
            started.append(start_process(target, (args, rank, addr), name))
    return started


# The children's entry points, by name: the scheduler and worker modules import torch (unless
# the scheduler runs the torch-free runner), which the owner process (the user's, or the HTTP
# server's) never needs; the fork server has it preloaded (runtime/preload_torch.py), so the
# child pays nothing for the import here.
def _run_scheduler(*args) -> None:
    from loom.runtime.scheduler.loop import run_scheduler_process

    run_scheduler_process(*args)


def _run_worker(*args) -> None:
    from loom.runtime.parallel_worker import run_worker_process

    run_worker_process(*args)


def start_runtime_processes(args: ServerArgs, ipc, procs: list):
    """Start the scheduler ranks and the detokenizer on `ipc` (appended to `procs` as they
    start); returns (scheduler info, tokenizer)."""
    from loom.runtime.detokenizer import run_detokenizer_process
    from loom.runtime.process import set_preload, start_process, wait_all_ready
    from loom.runtime.runner_choice import choose
    from loom.runtime.tokenizer import load_tokenizer

    # the fork server without torch when the scheduler runs torch-free (if it starts here)
    set_preload(with_torch=not choose(args))
    ranks = start_scheduler_ranks(args, ipc)
    procs.extend(p for p, _ in ranks)
    detok = start_process(run_detokenizer_process, (args, ipc), "detokenizer")
    procs.append(detok[0])
    tokenizer = None if args.skip_tokenizer_init else load_tokenizer(args.tokenizer_path)
    info, *_ = wait_all_ready([*ranks, detok], _START_TIMEOUT)
    return info, tokenizer


def serve_other_node(args: ServerArgs) -> int:
    """node_rank > 0 of a multi-node layout: run this node's ranks (no HTTP, no sockets) until
    one of them exits; returns 1 then (0 on SIGTERM/SIGINT)."""
    from multiprocessing.connection import wait

    from loom.runtime.process import IPCNames, wait_all_ready

    procs: list = []
    ipc = IPCNames.fresh()
    try:
        ranks = start_scheduler_ranks(args, ipc)
        procs.extend(p for p, _ in ranks)
        wait_all_ready(ranks, _START_TIMEOUT)
        logger.info("node %d: ranks %s ready", args.node_rank, list(args.node_ranks))
        dead = wait([p.sentinel for p in procs])
        proc = next(p for p in procs if p.sentinel in dead)
        proc.join(1.0)
        logger.error("shutting down: the %s process died (exit code %s)", proc.name, proc.exitcode)
        return 1
    finally:
        stop_processes(procs)
        ipc.remove()


def stop_processes(procs: list) -> None:
    from loom.runtime.process import stop_fork_server_if_idle

    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
    stop_fork_server_if_idle()


def _exit_on_signal(signum, frame):
    raise SystemExit(0)


def _start_fork_server_early(args: ServerArgs) -> None:
    """The scheduler's fork server preloads torch (when the torch runner serves) while this
    process imports transformers for the config: the two imports overlap instead of running
    one after the other. start_runtime_processes chooses the same preload and finds it up.
    Flags the choice cannot read (a bad path) leave it to start_runtime_processes, which
    reports them after load_config has."""
    from loom.runtime.process import set_preload, start_fork_server_early
    from loom.runtime.runner_choice import why_not

    try:
        with_torch = why_not(args) is not None  # choose's answer, without its log line
    except Exception:  # noqa: BLE001 - load_config names the problem next
        return
    set_preload(with_torch)
    start_fork_server_early()


def launch_server(args: ServerArgs) -> int:
    """Serve until stopped; returns the exit code (1 when a runtime process died)."""
    import uvicorn

    from loom.runtime.model_config import load_config
    from loom.runtime.process import IPCNames, configure_logging, yield_to_scheduler
    from loom.runtime.server.app import create_app
    from loom.runtime.server.common import ServerState
    from loom.runtime.tokenizer_manager import TokenizerManager

    configure_logging(args.log_level)
    if args.dp_size == 1 and args.node_rank == 0:
        _start_fork_server_early(args)
    config = load_config(args.model_path)  # a bad path or split fails here, clearly
    if args.world_size > 1 or args.nnodes > 1:  # distributed imports torch: not for one rank
        from loom.runtime.distributed import check_layout

        check_layout(args, config)
    chat_template = load_chat_template(args.chat_template)
    # uvicorn restores this handler and re-raises the signal after its graceful shutdown, so
    # a SIGTERM/SIGINT at any time (start-up included) ends in SystemExit(0) and the cleanup below.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_on_signal)
        signal.signal(signal.SIGINT, _exit_on_signal)
    if args.dp_size > 1:  # N replicas behind an in-process router (R's hook)
        from loom.runtime.router.dp import launch_dp_server

        return launch_dp_server(args)
    if args.node_rank > 0:
        return serve_other_node(args)
    procs: list = []
    ipc = IPCNames.fresh()
    try:
        info, tokenizer = start_runtime_processes(args, ipc, procs)
        tm = TokenizerManager(args, ipc, tokenizer, info["context_length"], info["vocab_size"])
        tm.watched_processes = list(procs)
        state = ServerState(args, tm, info, procs, chat_template)
        if args.enable_metrics:
            from loom.runtime.server.metrics import Metrics

            state.metrics = Metrics(args.served_model_name)
            tm.on_output = state.metrics.on_output
        state.on_shutdown = lambda: stop_processes(procs)
        config = uvicorn.Config(
            create_app(state),
            host=args.host,
            port=args.port,
            log_level=args.log_level.lower(),
            access_log=args.log_level.lower() == "debug",
            timeout_graceful_shutdown=5,
        )
        server = uvicorn.Server(config)
        exit_code = 0

        def on_dead(reason: str) -> None:
            nonlocal exit_code
            logger.error("shutting down: %s", reason)
            exit_code = 1
            server.should_exit = True
            # The surviving children are stopped now, not after uvicorn's drain.
            threading.Thread(target=stop_processes, args=(procs,), daemon=True).start()
            timer = threading.Timer(_FORCED_EXIT_AFTER, os._exit, args=(1,))
            timer.daemon = True
            timer.start()

        tm.on_dead = on_dead
        yield_to_scheduler(args)  # the event loop wakes per streamed token
        server.run()
        if exit_code:
            # A dead runtime: leave now. Tearing down an interpreter that imported torch and
            # transformers takes seconds of CPU (over 10 s at load 10 on 2 cores), and the
            # forced-exit timer cannot fire once finalization has begun.
            stop_processes(procs)
            ipc.remove()
            logging.shutdown()
            os._exit(exit_code)
        return exit_code
    finally:
        stop_processes(procs)
        ipc.remove()
