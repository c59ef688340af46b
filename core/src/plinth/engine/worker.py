"""A worker rank (every rank but 0): set up as rank 0 does, then run each
step rank 0 sends until it says stop. Its exit status says why it ended:
0 stopped by rank 0, 1 failed (a collective error or timeout: rank 0 died or
hung, or a rank of its groups did)."""

from __future__ import annotations

import logging
import os
import sys

import torch

from plinth.engine.config import EngineConfig

log = logging.getLogger("plinth.worker")


def worker_main(config: EngineConfig, rank: int, local_rank: int, port: int) -> int:
    import torch.distributed as dist

    from plinth.engine.distributed import (
        OP_NOOP,
        OP_STEP,
        OP_STOP,
        RankForward,
        control,
        make_store,
        metadata_from,
        setup_rank,
        unpack_step,
    )  # fmt: skip
    from plinth.engine.model_runner import ModelRunner

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s rank{rank} %(name)s %(levelname)s: %(message)s")
    parent = os.getppid()

    def alive() -> None:
        if os.getppid() != parent:
            raise SystemExit(f"rank {rank}: its launcher exited")

    try:
        store = make_store(config, False, port)
        setup = setup_rank(config, None, rank, local_rank, store, alive)
        layout, g = setup.layout, setup.groups
        runner = ModelRunner(
            setup.model, setup.ops, setup.model_cfg, device=setup.device, dtype=setup.dtype,
            num_pages=setup.num_pages + 1, page_size=config.page_size,
        )  # fmt: skip
        forward = RankForward(setup, runner)
        header = torch.zeros(2, dtype=torch.long)
        while True:
            header.zero_()
            control(header, setup.ctrl)
            op, n = int(header[0]), int(header[1])
            if op == OP_NOOP:
                continue
            if op == OP_STOP:
                break
            if op != OP_STEP:
                raise RuntimeError(f"rank {rank}: unknown control op {op}")
            payload = torch.empty(n, dtype=torch.long)
            dist.broadcast(payload, src=0, group=setup.ctrl)
            decode, mine, _ = unpack_step(payload, layout.dp, g.dp_rank)
            if mine is None:
                forward.run(None, None, [], [], decode)
                continue
            ids, meta, rows, copies = metadata_from(mine, config.page_size, setup.device, decode)
            logits = forward.run(ids, meta, rows, copies, decode)
            if g.dp_rank > 0 and g.tp_rank == 0 and logits is not None:
                dist.send(logits.contiguous(), dst=0, group=setup.ctrl)
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
