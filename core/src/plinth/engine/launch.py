"""Launching the ranks of a multi-process engine and joining them in one
torch.distributed world.

Rank 0 (``LLM`` or ``platform serve``) starts the other ranks of its node as
fresh interpreters (``python -m plinth.engine.worker``, ``WorkerProcess``;
other nodes run ``platform serve --node-rank k``: workers only). Every rank
then starts through ``startup.start_process`` with a ``RankJoin``, its part
in start-up: the rendezvous on rank 0's TCP store, the process group and the
TP/DP/EP groups, the cores a node's ranks share, a wait for every rank to
have loaded before the first collective of the model, the smallest KV pool
of any rank.

Start-up may take minutes on one rank and seconds on another (imports,
weights), while a collective of the model's groups fails after
``dist_timeout`` (10 s by default): every wait of start-up goes through the
store, with ``STARTUP_TIMEOUT_S``, and checks meanwhile that no local rank
died (``wait_while``).
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from typing import Any, Callable

import torch

from plinth.engine.config import EngineConfig
from plinth.engine.interfaces import DeadRankError
from plinth.engine.parallel import ParallelGroups, ParallelLayout, init_groups
from plinth.errors import ConfigError

log = logging.getLogger("plinth.distributed")

#: start-up (imports, weight loading, rendezvous) may take much longer than a step
STARTUP_TIMEOUT_S = float(os.environ.get("PLINTH_DIST_STARTUP_TIMEOUT", "600"))


def resolve_layout(config: EngineConfig) -> ParallelLayout:
    p = config.parallel
    return ParallelLayout.resolve(p.tp, p.dp, p.ep)


def check_supported(config: EngineConfig, layout: ParallelLayout) -> None:
    """What a multi-rank engine refuses, before any rank starts."""
    why = []
    if config.kv_transfer.kv_connector or (config.kv_transfer.kv_connector_config or {}).get("kv_connector"):
        why.append("a KV connector (--kv-connector)")
    if config.speculative.speculative_method:
        why.append("speculative decoding (--speculative-method)")
    if why:
        raise ConfigError(f"{' and '.join(why)} cannot run with more than one rank yet (tp={layout.tp}, dp={layout.dp}, ep={layout.ep})")
    p = config.parallel
    if p.nnodes < 1 or layout.world % p.nnodes:
        raise ConfigError(f"the world (tp x dp = {layout.world}) does not split evenly over --nnodes {p.nnodes}")
    if not 0 <= p.node_rank < p.nnodes:
        raise ConfigError(f"--node-rank {p.node_rank} is outside 0..{p.nnodes - 1}")
    if p.nnodes > 1 and not (p.master_addr and p.master_port):
        raise ConfigError("with --nnodes > 1, give --master-addr and --master-port (rank 0's node)")


def free_port(host: str = "127.0.0.1") -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_while(fn: Callable[[], Any], alive: Callable[[], None], what: str, timeout: float) -> Any:
    """Run a blocking call on a helper thread, checking ``alive`` (which
    raises on a dead rank) meanwhile: start-up never hangs on a dead rank."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc

    t = threading.Thread(target=run, name=f"plinth-{what}", daemon=True)
    t.start()
    deadline = time.monotonic() + timeout
    while t.is_alive():
        t.join(0.1)
        alive()
        if time.monotonic() > deadline:
            raise DeadRankError(f"{what} did not finish within {timeout:.0f} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def make_store(config: EngineConfig, is_master: bool, port: int) -> Any:
    import torch.distributed as dist

    addr = config.parallel.master_addr or "127.0.0.1"
    # TCPStore is torch's documented API; its stubs re-export it without saying so
    return dist.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
        addr, port, is_master=is_master, timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S), wait_for_workers=False
    )


class RankJoin:
    """A rank's part in ``startup.start_process`` (its ``JoinWorld``): the
    rendezvous, the process group and the TP/DP/EP groups, the cores shared
    by a node's ranks, the waits for every rank, the smallest KV pool of any
    rank. Afterwards it holds the layout, the groups and the control group."""

    def __init__(self, config: EngineConfig, rank: int, local_rank: int, store: Any, alive: Callable[[], None]) -> None:
        self.config = config
        self.layout = resolve_layout(config)
        self.rank = rank
        self.local_rank = local_rank
        self.store = store
        self.alive = alive
        self.groups: ParallelGroups | None = None
        self.ctrl: Any = None  # the control group (steps, heartbeats, results back)

    def share_cores(self, options: dict[str, Any]) -> dict[str, Any]:
        """The options with the thread count of ranks sharing a node's cores."""
        per_node = self.layout.world // self.config.parallel.nnodes
        if per_node > 1 and not os.environ.get("OMP_NUM_THREADS") and not options.get("cpu_threads"):
            # the ranks of a node share its cores: threads each would oversubscribe them
            threads = max(1, min(torch.get_num_threads(), (os.cpu_count() or 1) // per_node))
            torch.set_num_threads(threads)
            return {**options, "cpu_threads": threads}
        return options

    def join(self, accelerator: Any) -> ParallelGroups:
        import torch.distributed as dist

        world = self.layout.world
        timeout = datetime.timedelta(seconds=self.config.parallel.dist_timeout)
        # every rank is up (imports done) before the group forms, whose own timeout is short
        self.ready("up")
        backend = accelerator.dist_backend  # the accelerator names its collective library
        bound = accelerator.process_group_device(self.local_rank)
        device_id = {} if bound is None else {"device_id": bound}  # communicators made now, not at the first collective
        dist.init_process_group(backend, store=self.store, rank=self.rank, world_size=world, timeout=timeout, **device_id)
        self.groups = init_groups(self.layout, self.rank, timeout=timeout)
        # steps and heartbeats travel on a host group: torch's gloo is the CPU backend every build has
        self.ctrl = None if backend == "gloo" else dist.new_group(list(range(world)), backend="gloo", timeout=timeout)
        return self.groups

    def ready(self, stage: str) -> None:
        """Every rank reached ``stage`` (through the store, with the start-up
        timeout: never a collective of the model's groups, whose timeout is
        short). A rank that gets there first (its weights loaded sooner)
        waits here, not in an all-reduce that fails after ``dist_timeout``."""
        key = stage.replace(" ", "_")
        self.store.set(f"plinth/{key}/{self.rank}", "1")
        keys = [f"plinth/{key}/{r}" for r in range(self.layout.world)]
        wait_while(lambda: self.store.wait(keys), self.alive, f"{stage} on every rank", STARTUP_TIMEOUT_S)

    def agree_num_pages(self, pages: list[int]) -> list[int]:
        # ranks of one node share its memory: the store again, as profiling may take any time
        self.store.set(f"plinth/pages/{self.rank}", ",".join(map(str, pages)))
        keys = [f"plinth/pages/{r}" for r in range(self.layout.world)]
        wait_while(lambda: self.store.wait(keys), self.alive, "sizing the KV pool on every rank", STARTUP_TIMEOUT_S)
        every = [[int(n) for n in self.store.get(k).decode().split(",")] for k in keys]
        return [min(group) for group in zip(*every)]


# ---- worker processes ------------------------------------------------------------------------


class WorkerProcess:
    """One worker rank: a fresh interpreter running ``python -m
    plinth.engine.worker`` (never the user's ``__main__``: a script without a
    main guard, ``python -`` and notebooks all work). Its configuration
    arrives pickled on stdin."""

    def __init__(self, config: EngineConfig, rank: int, local_rank: int, port: int) -> None:
        import pickle
        import subprocess
        import sys

        self.rank = rank
        cmd = [sys.executable, "-m", "plinth.engine.worker", "--rank", str(rank), "--local-rank", str(local_rank), "--port", str(port)]
        self.popen = subprocess.Popen(cmd, stdin=subprocess.PIPE)
        self.pid = self.popen.pid
        assert self.popen.stdin is not None
        try:
            self.popen.stdin.write(pickle.dumps(config))
            self.popen.stdin.close()
        except BrokenPipeError:  # it died at once: exitcode says so
            pass

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def describe(self) -> str:
        return f"rank {self.rank} (pid {self.pid}) exited with code {self.exitcode}"

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()

    def join(self, timeout: float) -> None:
        import subprocess

        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass


def spawn_workers(config: EngineConfig, layout: ParallelLayout, node_rank: int, port: int) -> list[WorkerProcess]:
    """This node's ranks but its first (which runs in this process)."""
    per_node = layout.world // config.parallel.nnodes
    first = node_rank * per_node
    return [WorkerProcess(config, first + local, local, port) for local in range(1, per_node)]


def stop_workers(procs: list[WorkerProcess], kill: bool, timeout: float = 5.0) -> None:
    """Wait for workers to exit (killing them first with ``kill``, or after ``timeout``)."""
    for p in procs:
        if kill:
            p.kill()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.exitcode is None:
            p.kill()
            p.join(5)


def dead_worker(procs: list[WorkerProcess], wait: float = 1.0) -> str | None:
    """Which local worker died (a broken collective is usually the first sign), waiting up to ``wait``."""
    deadline = time.monotonic() + wait
    while True:
        for p in procs:
            if p.exitcode is not None:
                return p.describe()
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)
