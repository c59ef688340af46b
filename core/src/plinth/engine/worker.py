"""A worker rank (every rank but 0): started as ``python -m
plinth.engine.worker --rank R --local-rank L --port P`` with its pickled
``EngineConfig`` on stdin (``launch.WorkerProcess``), it starts as rank
0 does (``startup.start_process``), then runs each step rank 0 sends until it
says stop. Its exit status says why it ended: 0 stopped by rank 0, 1 failed
(a collective error or timeout: rank 0 died or hung, or a rank of its groups
did)."""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import sys

import torch

from plinth.engine.config import EngineConfig
from plinth.engine.launch import RankJoin, check_supported, make_store, resolve_layout, spawn_workers, stop_workers
from plinth.engine.multiproc import RankForward
from plinth.engine.startup import start_process
from plinth.engine.wire import OP_NOOP, OP_STEP, OP_STOP, control, decode_job, part_from, send_result, unpack_step
from plinth.errors import ConfigError
from plinth.plugins import PluginRegistry

log = logging.getLogger("plinth.worker")


def worker_main(config: EngineConfig, rank: int, local_rank: int, port: int) -> int:
    import torch.distributed as dist

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s rank{rank} %(name)s %(levelname)s: %(message)s")
    parent = os.getppid()

    def alive() -> None:
        if os.getppid() != parent:
            raise SystemExit(f"rank {rank}: its launcher exited")

    try:
        world = RankJoin(config, rank, local_rank, make_store(config, False, port), alive)
        started = start_process(config, PluginRegistry.discover(), world)
        forward = RankForward(started)
        layout, g = world.layout, world.groups
        assert g is not None
        header = torch.zeros(2, dtype=torch.long)
        while True:
            header.zero_()
            control(header, world.ctrl)
            op, n = int(header[0]), int(header[1])
            if op == OP_NOOP:
                continue
            if op == OP_STOP:
                break
            if op != OP_STEP:
                raise RuntimeError(f"rank {rank}: unknown control op {op}")
            payload = torch.empty(n, dtype=torch.long)
            dist.broadcast(payload, src=0, group=world.ctrl)
            decode, mine = unpack_step(payload, layout.dp, g.dp_rank, forward.num_groups)
            part = None if mine is None else part_from(mine, forward.runner, decode)
            logits = forward.run(part, decode)
            if part is not None and logits is not None and g.dp_rank > 0 and g.tp_rank == 0:
                # this group's rows are sampled where their logits are: ids and logprobs go to rank 0
                send_result(decode_job(part.job, logits.shape[-1]).run(logits, forward.sampler), world.ctrl)
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - reported, then a non-zero exit
        print(f"plinth rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        os._exit(1)  # a broken collective may leave threads that would block a normal exit
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    return 0


def run_node(config: EngineConfig) -> int:
    """A node other than 0 (``--node-rank k``): run its ranks until rank 0 stops them."""
    layout = resolve_layout(config)
    check_supported(config, layout)
    p = config.parallel
    if p.master_port is None:
        raise ConfigError("a node other than 0 needs --master-port (rank 0's)")
    per_node = layout.world // p.nnodes
    procs = spawn_workers(config, layout, p.node_rank, p.master_port)
    try:
        return worker_main(config, p.node_rank * per_node, 0, p.master_port)
    finally:
        stop_workers(procs, kill=False, timeout=10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m plinth.engine.worker", description="one worker rank (started by rank 0)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--local-rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    config = pickle.load(sys.stdin.buffer)
    if not isinstance(config, EngineConfig):
        raise SystemExit(f"rank {args.rank}: stdin did not hold an EngineConfig")
    return worker_main(config, args.rank, args.local_rank, args.port)


if __name__ == "__main__":
    sys.exit(main())
