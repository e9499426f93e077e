"""`--distributed-executor-backend ray`: Ray places the ranks, torch.distributed still carries
the collectives.

Layout (vLLM's Ray executor keeps its driver worker the same way): rank 0 is the scheduler
and owns the ZMQ sockets the tokenizer manager and detokenizer talk to, so it stays a local
process of the server or Engine (started as with the default `mp` launch). Ranks 1..N-1 are
Ray actors (`RankActor`, one CPU or GPU each) that Ray places anywhere on the cluster; each
runs the same worker loop as an `mp` rank (parallel_worker.serve_steps). Ray passes only the
rendezvous address: the ranks then join the gloo (NCCL on CUDA) group as they would by hand.

With `loom serve --dp-size N`, each replica is a whole server started by a `ReplicaActor` on
the node Ray picks, reached by the in-process router over HTTP (router/dp.py).

Supervision: `RayRank` gives an actor the interface of a `multiprocessing.Process` and of its
ready pipe, so the launch code (process.wait_all_ready, launch.stop_processes) and the tokenizer
manager's watchdog (which waits on `sentinel`) treat it as any rank. A thread blocks on the
actor's `run` call; when the actor's process dies (killed, OOM, node lost) Ray fails that call
within a second or so, the thread closes the sentinel pipe, and the server or Engine declares
the runtime dead naming the rank, instead of waiting for rank 0's next collective (an idle
rank 0 is in no collective and would never notice).
"""

from __future__ import annotations

import logging
import os
import signal
import threading

logger = logging.getLogger(__name__)


def connect(args) -> None:
    """Join the Ray cluster at args.ray_address; None: RAY_ADDRESS, else a cluster already
    running on this machine, else a new local one (ray.init's own rule)."""
    import ray

    if ray.is_initialized():
        return
    # ray.init puts in a SIGTERM handler that exits with code 15; the server's own handler
    # (launch._exit_on_signal: a clean stop, exit 0, children stopped) stays
    main = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGTERM) if main else None
    ray.init(address=args.ray_address, log_to_driver=False, logging_level=logging.WARNING)
    if main and handler is not None:
        signal.signal(signal.SIGTERM, handler)


def driver_node_ip() -> str:
    """This process's node address as the cluster knows it: the other ranks reach rank 0's
    rendezvous there."""
    import ray

    me = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node["NodeID"] == me:
            return node["NodeManagerAddress"]
    return ray.util.get_node_ip_address()


def _ray_node() -> dict:
    import ray

    ctx = ray.get_runtime_context()
    return {"ray_node_id": ctx.get_node_id(), "ray_actor_id": ctx.get_actor_id()}


class RankActor:
    """One rank > 0 on a Ray worker process: `setup` joins the group and loads the shard,
    `run` serves rank 0's steps until the group ends (Ray runs an actor's calls in order, so
    `run` may be submitted before `setup` has finished)."""

    def setup(self, args, rank: int, addr: str) -> dict:
        import multiprocessing as mp
        import traceback

        from loom.runtime.parallel_worker import setup_rank
        from loom.runtime.process import configure_logging, freeze_startup_heap

        mp.current_process().name = f"scheduler-rank{rank}"
        configure_logging(args.log_level)
        self.rank = rank
        try:
            self.runner, _ = setup_rank(args, rank, addr, extra=_ray_node())
        except Exception as e:  # noqa: BLE001 - reported to the owner, which raises it
            logger.error(traceback.format_exc())
            self.runner = None
            return {"error": f"rank {rank} failed to start: {e}"}
        freeze_startup_heap()
        return {"ok": True, "rank": rank, "pid": os.getpid(), **_ray_node()}

    def run(self) -> str:
        from loom.runtime.parallel_worker import serve_steps

        if self.runner is None:
            return "not started"
        try:
            serve_steps(self.runner)
        except Exception as e:  # noqa: BLE001 - a lost peer: this rank cannot go on
            logger.error("rank %d stopped: %s", self.rank, e)
            return f"stopped: {e}"
        return "done"


class RayRank:
    """A RankActor seen as a multiprocessing.Process (name, is_alive, exitcode, sentinel,
    terminate, kill, join) and as its ready pipe (poll, recv)."""

    def __init__(self, args, rank: int, addr: str, resources: dict):
        import ray

        self.rank = rank
        self.name = f"scheduler-rank{rank} (Ray actor)"
        self.exitcode = None
        self.pid = None
        cls = ray.remote(RankActor)
        self.actor = cls.options(
            name=None, max_restarts=0, max_task_retries=0, **resources
        ).remote()
        self._setup = self.actor.setup.remote(args, rank, addr)
        self._run = self.actor.run.remote()
        self._read_fd, self._write_fd = os.pipe()
        self.sentinel = self._read_fd
        self._done = threading.Event()
        threading.Thread(target=self._watch, name=f"ray-rank{rank}", daemon=True).start()

    def _watch(self) -> None:
        import ray

        try:
            outcome = ray.get(self._run)
        except Exception as e:  # noqa: BLE001 - the actor died: say how, in one line
            outcome = f"Ray actor died: {str(e).strip().splitlines()[0][:300]}"
        self.exitcode = outcome
        self._done.set()
        os.close(self._write_fd)  # the sentinel turns readable, as a dead process's does

    # -- the ready pipe
    def poll(self, timeout: float = 0.0) -> bool:
        import ray

        ready, _ = ray.wait([self._setup], timeout=timeout)
        return bool(ready)

    def recv(self) -> dict:
        import ray

        try:
            msg = ray.get(self._setup)
        except Exception as e:  # noqa: BLE001 - the actor died before it was ready
            first = str(e).strip().splitlines()[0][:300]
            return {"error": f"rank {self.rank}'s Ray actor died during start-up: {first}"}
        self.pid = msg.get("pid")
        return msg

    # -- the process
    def is_alive(self) -> bool:
        return not self._done.is_set()

    def join(self, timeout: float | None = None) -> None:
        self._done.wait(timeout)

    def terminate(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)

    kill = terminate


def start_ray_ranks(args, addr: str) -> list[RayRank]:
    """Ranks 1..world_size-1 as Ray actors, one CPU (one GPU on CUDA) each; Ray's default
    scheduling places them on any node with the resources free."""
    connect(args)
    need = {"num_gpus": 1} if args.resolved_device.startswith("cuda") else {"num_cpus": 1}
    return [RayRank(args, rank, addr, need) for rank in range(1, args.world_size)]


def rendezvous_addr(args) -> str:
    """host:port of rank 0's rendezvous, reachable from the other nodes: --dist-init-addr,
    else a free port on this node's cluster address."""
    import socket

    if args.dist_init_addr:
        return args.dist_init_addr
    connect(args)
    host = driver_node_ip()
    with socket.socket() as s:
        s.bind((host, 0))
        return f"{host}:{s.getsockname()[1]}"


class ReplicaActor:
    """One `--dp-size` replica: a whole loom server (`python -m loom.launch_server`) started
    on the node Ray placed this actor on, on a free port of that node's cluster address. The
    server dies with the actor's process (PR_SET_PDEATHSIG)."""

    def start(self, args, index: int, env: dict) -> dict:
        import subprocess
        import sys
        import tempfile

        import ray

        from loom.runtime.process import die_with_parent
        from loom.runtime.server.runtime_client import free_port, server_argv

        host = ray.util.get_node_ip_address()
        args = args.replace(host=host, port=free_port(host))
        self.log = tempfile.NamedTemporaryFile(prefix=f"loom-dp{index}-", suffix=".log", delete=False)  # fmt: skip
        self.process = subprocess.Popen(
            [sys.executable, "-m", "loom.launch_server", *server_argv(args)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
            preexec_fn=die_with_parent,
        )
        return {"url": f"http://{host}:{args.port}", "pid": self.process.pid, **_ray_node()}

    def poll(self):
        return self.process.poll()

    def tail(self, chars: int) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()[-chars:]

    def stop(self, timeout: float):
        import signal
        import subprocess

        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(max(0.1, timeout))
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(5)


class RayReplica:
    """router/dp.Replica's interface (url, wait_healthy, tail, terminate, reap) over a
    ReplicaActor; `process.poll()` answers for the actor's server (-1 once the actor is lost)."""

    def __init__(self, args, index: int):
        import ray

        from loom.runtime.server_args import API_KEY_ENV

        connect(args)
        self.index = index
        # the replica itself runs its ranks with the mp launch, on the node Ray chose
        replica = args.replace(
            dp_size=1,
            load_balance_method=type(args).load_balance_method,
            distributed_executor_backend="mp",
            ray_address=None,
        )
        env = {API_KEY_ENV: args.api_key} if args.api_key else {}
        self.actor = ray.remote(ReplicaActor).options(num_cpus=1, max_restarts=0).remote()
        info = ray.get(self.actor.start.remote(replica, index, env), timeout=300)
        self.url, self.pid, self.ray_node_id = info["url"], info["pid"], info["ray_node_id"]
        self.process = self
        self._stop_ref = None
        logger.info("dp replica %d on Ray node %s: %s", index, self.ray_node_id, self.url)

    def poll(self):
        import ray

        try:
            return ray.get(self.actor.poll.remote(), timeout=30)
        except Exception:  # noqa: BLE001 - the actor (and so its server) is gone
            return -1

    def wait_healthy(self, timeout: float) -> None:
        from loom.runtime.server.runtime_client import wait_for_health

        status = wait_for_health(self.url, self, timeout)
        if status == "exited":
            raise RuntimeError(f"dp replica {self.index} exited during start-up:\n{self.tail()}")
        if status == "timeout":
            raise RuntimeError(f"dp replica {self.index} not healthy in {timeout}s:\n{self.tail()}")

    def tail(self, chars: int = 3000) -> str:
        import ray

        try:
            return ray.get(self.actor.tail.remote(chars), timeout=30)
        except Exception as e:  # noqa: BLE001
            return f"(the replica's Ray actor is gone: {e})"

    def terminate(self) -> None:
        self._stop_ref = self.actor.stop.remote(25.0)

    def reap(self, timeout: float) -> None:
        import ray

        try:
            if self._stop_ref is not None:
                ray.get(self._stop_ref, timeout=max(0.1, timeout))
        except Exception:  # noqa: BLE001 - stopped or lost: the actor goes either way
            pass
        ray.kill(self.actor, no_restart=True)
