"""`--dp-size N` on `loom serve`: N data-parallel replicas behind an in-process router.

Each replica is a whole loom server with `dp_size=1` (its own scheduler, KV pool and radix
cache, its own tokenizer and detokenizer processes) on a private 127.0.0.1 port; this process
serves the router app (app.py) on `--host/--port` with `--load-balance-method` as the policy,
so the replicas are reached exactly as `loom router` reaches separate servers (streams, retries,
health checks, /get_server_info with each replica's load and hit rate, per-replica metrics).
Replicas die with this process (PR_SET_PDEATHSIG) and get its SIGTERM on a clean stop. A
replica that dies is removed from the pool and the others keep serving; when none is left,
/health answers 503. CPU threads are split between replicas (`cpu_threads` / N, at least 1).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import signal
import subprocess
import sys
import tempfile

from loom.runtime.process import die_with_parent
from loom.runtime.server_args import API_KEY_ENV, ServerArgs

logger = logging.getLogger(__name__)


class Replica:
    def __init__(self, args: ServerArgs, index: int):
        from loom.runtime.server.runtime_client import free_port, server_argv

        self.index = index
        self.args = args.replace(
            host="127.0.0.1",
            port=free_port(),
            dp_size=1,
            load_balance_method=ServerArgs.load_balance_method,
        )
        self.url = f"http://127.0.0.1:{self.args.port}"
        self.log = tempfile.NamedTemporaryFile(
            prefix=f"loom-dp{index}-", suffix=".log", delete=False
        )
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if args.api_key:
            env[API_KEY_ENV] = args.api_key
        self.process = subprocess.Popen(
            [sys.executable, "-m", "loom.launch_server", *server_argv(self.args)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=die_with_parent,
        )

    def wait_healthy(self, timeout: float) -> None:
        from loom.runtime.server.runtime_client import wait_for_health

        status = wait_for_health(self.url, self.process, timeout)
        if status == "exited":
            raise RuntimeError(f"dp replica {self.index} exited during start-up:\n{self.tail()}")
        if status == "timeout":
            raise RuntimeError(f"dp replica {self.index} not healthy in {timeout}s:\n{self.tail()}")

    def tail(self, chars: int = 3000) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()[-chars:]

    def terminate(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def reap(self, timeout: float) -> None:
        try:
            self.process.wait(max(0.1, timeout))
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)
        self.log.close()


def stop_replicas(replicas: list[Replica], timeout: float = 30.0) -> None:
    """SIGTERM to all at once (each takes seconds to stop its children), then reap."""
    import time

    for r in replicas:
        r.terminate()
    deadline = time.monotonic() + timeout
    for r in replicas:
        r.reap(deadline - time.monotonic())


def launch_dp_server(args: ServerArgs, start_timeout: float = 600.0) -> int:
    """Serve `args` as args.dp_size replicas behind the router until stopped."""
    import uvicorn

    from loom.runtime.process import configure_logging, yield_to_scheduler
    from loom.runtime.router.app import create_app
    from loom.runtime.router.args import RouterArgs

    configure_logging(args.log_level)
    threads = max(1, args.effective_cpu_threads // args.dp_size)
    replica_args = args.replace(cpu_threads=threads)
    replicas: list[Replica] = []
    try:
        if args.distributed_executor_backend == "ray":  # each replica where Ray places it
            from loom.runtime.ray_executor import RayReplica as make
        else:
            make = Replica
        replicas += [make(replica_args, i) for i in range(args.dp_size)]
        with concurrent.futures.ThreadPoolExecutor(len(replicas)) as pool:
            for done in [pool.submit(r.wait_healthy, start_timeout) for r in replicas]:
                done.result()
        logger.info("dp: %d replicas up: %s", len(replicas), [r.url for r in replicas])
        router_args = RouterArgs(
            worker_urls=tuple(r.url for r in replicas),
            policy=args.load_balance_method,
            host=args.host,
            port=args.port,
            api_key=args.api_key,
            health_check_interval=1.0,
            log_level=args.log_level,
        )
        config = uvicorn.Config(
            create_app(router_args),
            host=args.host,
            port=args.port,
            log_level=args.log_level.lower(),
            timeout_graceful_shutdown=5,
        )
        # the router's loop wakes per streamed token (the replicas, started before, stay
        # SCHED_NORMAL)
        yield_to_scheduler(args)
        uvicorn.Server(config).run()
        return 0
    finally:
        stop_replicas(replicas)
