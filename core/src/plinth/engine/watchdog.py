"""A multi-process engine's health: the failure that stops it, the
watchdog, the heartbeat, and stopping the ranks.

The control group and the model's groups carry a short collective timeout
(``dist_timeout``, 10 s by default); rank 0 sends a heartbeat (an
all-reduce, so a stopped rank is noticed too) every second while idle, and
the watchdog thread polls this node's worker processes. A dead or hung rank
turns into ``DeadRankError``, and so does any failure once a step went out
to the ranks (they are then out of step, whatever the error was): every
later step refuses, the async engine stops (so ``/health`` fails), and the
other ranks exit on their own collective error or timeout.

``WorldControl`` holds only what stopping needs (the workers, the control
group, the lock that orders steps and heartbeats), never the engine: the
watchdog thread and the finaliser that stops the ranks when the engine is
dropped (``del llm``) keep no engine alive.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch

from plinth.engine.interfaces import CLOSE_TIMEOUT_S, DeadRankError
from plinth.engine.launch import WorkerProcess, dead_worker, stop_workers
from plinth.engine.wire import OP_NOOP, OP_STOP, control

log = logging.getLogger("plinth.distributed")

#: idle seconds between heartbeats
HEARTBEAT_S = 1.0


class WorldControl:
    """The control group of rank 0's world and what stops it."""

    def __init__(self, procs: list[WorkerProcess], ctrl: Any) -> None:
        self.procs = procs  # this node's worker processes
        self.ctrl = ctrl
        self.lock = threading.Lock()  # the control group: steps and heartbeats in one order
        self.failure: DeadRankError | None = None
        self.closed = False
        self.last = time.monotonic()  # when the control group last carried something
        self.stop_event = threading.Event()
        self.watchdog: threading.Thread | None = None  # started by ``watch``

    def fail(self, why: str) -> DeadRankError:
        """The world is broken: kill this node's ranks; the failure every later step raises."""
        if self.failure is None:
            self.failure = DeadRankError(f"the distributed engine failed: {why}; restart it")
            log.error("%s", self.failure)
        stop_workers(self.procs, kill=True)
        return self.failure

    def dead_rank(self, wait: float = 1.0) -> str | None:
        return dead_worker(self.procs, wait)

    def heartbeat(self) -> None:
        """An idle world's all-reduce, unless a step holds the control group."""
        if time.monotonic() - self.last <= HEARTBEAT_S or not self.lock.acquire(blocking=False):
            return
        try:
            if self.failure is None and not self.closed:
                control(torch.tensor([OP_NOOP, 0], dtype=torch.long), self.ctrl)
                self.last = time.monotonic()
        except Exception as exc:  # noqa: BLE001 - any heartbeat failure: a dead or hung rank
            self.fail(self.dead_rank() or f"the heartbeat failed: {type(exc).__name__}: {exc}")
        finally:
            self.lock.release()

    def shutdown(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stop every rank (a STOP step when they are healthy, else kill this
        node's), the watchdog, and this process's process groups. Idempotent."""
        if self.closed:
            return
        self.closed = True
        bound = time.monotonic() + timeout
        self.stop_event.set()
        import torch.distributed as dist

        if self.failure is None and self.lock.acquire(timeout=max(0.0, bound - time.monotonic())):
            try:
                control(torch.tensor([OP_STOP, 0], dtype=torch.long), self.ctrl)
            except Exception as exc:  # noqa: BLE001 - stopping anyway
                log.warning("stopping the ranks: %s", exc)
            finally:
                self.lock.release()
        stop_workers(self.procs, kill=self.failure is not None, timeout=max(1.0, bound - time.monotonic()))
        if self.watchdog is not None and self.watchdog is not threading.current_thread():
            self.watchdog.join(max(0.0, bound - time.monotonic()))
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001
            log.debug("destroy_process_group: %s", exc)


def watch(world: WorldControl) -> threading.Thread:
    """Start the watchdog: poll this node's workers, heartbeat while idle."""

    def run() -> None:
        while not world.stop_event.wait(0.2):
            if world.failure is not None or world.closed:
                return
            for p in world.procs:
                if p.exitcode is not None:
                    world.fail(p.describe())
                    return
            world.heartbeat()

    world.watchdog = threading.Thread(target=run, name="plinth-watchdog", daemon=True)
    world.watchdog.start()
    return world.watchdog
