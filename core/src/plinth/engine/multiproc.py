"""The multi-process executor: tp x dp ranks over torch.distributed.

Rank 0 is this process (``LLM`` or ``platform serve``); it launches the
other ranks (``plinth.engine.launch``), starts as every rank does
(``startup.start_process``) and then holds the world (``RankWorld``). Each
dp group's scheduler steps over a ``MultiprocExecutor``, the ``Executor`` of
that group: its batch goes to every rank in one step of the world
(``plinth.engine.wire``), every rank runs the same forward (``RankForward``),
rank 0 samples dp group 0 and the first tp rank of each other group samples
its own rows and sends back only ids and logprobs. With dp > 1 the groups'
schedulers step on their own threads (``plinth.engine.data_parallel``) and
their steps meet in rounds (``StepRounds``): one world step carries every
group that has work, the others run a dummy forward.

Failures (``plinth.engine.watchdog``): a dead or hung rank, or any failure
once a step went out to the ranks, is ``DeadRankError`` for every later
step. The world is stopped by ``close()``, or when the engine holding it is
dropped (``del llm``): a finaliser stops the ranks and destroys the process
groups, so a second multi-rank engine can start in the same process.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Any, Sequence

import torch

from plinth.engine.config import EngineConfig
from plinth.engine.executor import ExecuteOutput, Executor
from plinth.engine.interfaces import CLOSE_TIMEOUT_S, DeadRankError
from plinth.engine.launch import (
    RankJoin,
    check_supported,
    free_port,
    make_store,
    resolve_layout,
    spawn_workers,
    stop_workers,
)
from plinth.engine.model_runner import ModelRunner
from plinth.engine.sampler import SampleJob, Sampler, SampleResult
from plinth.engine.scheduler import ScheduledBatch
from plinth.engine.startup import Started, start_process
from plinth.engine.watchdog import WorldControl, watch
from plinth.engine.wire import (
    OP_STEP,
    StepPart,
    control,
    dummy_step,
    encode_job,
    group_metas,
    pack_step,
    receive_result,
)
from plinth.errors import ConfigError
from plinth.plugins import PluginRegistry

log = logging.getLogger("plinth.distributed")


class RankForward:
    """The forward every rank runs on its dp group's part of a step, over
    the model runner start-up built (one scratch page past each KV-cache
    group's pool takes the dummy forwards)."""

    def __init__(self, started: Started) -> None:
        self.runner: ModelRunner = started.runner
        self.scratch = list(started.resolved.num_pages)  # the first page past each group's pool
        self.sampler = Sampler()

    @property
    def num_groups(self) -> int:
        return len(self.runner.kv_groups)

    @torch.inference_mode()
    def run(self, part: StepPart | None, decode: bool) -> torch.Tensor | None:
        """The forward, and the logits of the part's rows (on the device)."""
        r = self.runner
        if part is not None and any(part.copies):
            r.copy_pages([[s for s, _ in c] for c in part.copies], [[d for _, d in c] for c in part.copies])
        if part is None:
            part = dummy_step(r, self.scratch, decode)
        r.prepare(part.meta)
        hidden = r.model(part.ids, part.meta.positions, r.kv_caches, part.meta)
        if not part.rows:
            return None
        idx = torch.tensor(part.rows, dtype=torch.long, device=hidden.device)
        return r.model.compute_logits(hidden.index_select(0, idx)).float()


class RankWorld:
    """Rank 0's side of the world: the workers, the control group, one step
    of every rank at a time."""

    def __init__(self, join: RankJoin, started: Started, procs: list[Any]) -> None:
        self.layout = join.layout
        self.forward = RankForward(started)
        self.vocab_size = started.model_cfg.vocab_size
        self.control = WorldControl(procs, join.ctrl)
        #: per dp group: bytes and rows its rank sent back (sampled ids and logprobs: never logits)
        self.result_bytes = [0] * self.layout.dp
        self.result_rows = [0] * self.layout.dp
        self.rounds = StepRounds(self) if self.layout.dp > 1 else None
        watch(self.control)
        # dropping the engine stops the ranks as close() does (the finaliser holds no engine)
        self._finalizer = weakref.finalize(self, self.control.shutdown)
        self._join = join  # the rendezvous store lives as long as the world

    @property
    def procs(self) -> list[Any]:
        return self.control.procs

    @property
    def failure(self) -> DeadRankError | None:
        return self.control.failure

    def executor(self, dp_rank: int) -> "MultiprocExecutor":
        """The executor of dp group ``dp_rank`` (with dp = 1 it owns the world: closing it stops the ranks)."""
        return MultiprocExecutor(self, dp_rank, owns_world=self.layout.dp == 1)

    def arrive(self, d: int, part: StepPart, job: SampleJob) -> SampleResult:
        """Dp group d's part of a step: run in this round of the world (with
        dp > 1, together with the other groups that have work)."""
        result = self.rounds.arrive(d, part, job) if self.rounds is not None else self.step({d: (part, job)})[d]
        if isinstance(result, BaseException):
            raise result
        return result

    def step(self, parts: dict[int, tuple[StepPart, SampleJob]]) -> dict[int, SampleResult | BaseException]:
        """One step of every rank: the given groups' parts, dummy forwards
        for the others; each group's sampled rows."""
        full: list[StepPart | None] = [None] * self.layout.dp
        for d, (part, job) in parts.items():
            part.job = b"" if d == 0 else encode_job(job, self.vocab_size)  # group 0's logits are here
            full[d] = part
        # decode only when every group decodes (a dummy forward is one decode token)
        decode = all(p is None or p.meta.max_query_len == 1 for p in full)
        for p in full:
            for m in group_metas(p.meta) if p is not None else ():
                m.moe_decode = decode
        payload = pack_step(full, decode, self.forward.num_groups)
        c = self.control
        with c.lock:
            if c.failure is not None:
                raise c.failure
            try:
                out, logits = self._run_world(payload, full, decode)
            except BaseException as exc:
                # once a step started on every rank, any failure leaves the
                # ranks out of step (some wait in a collective rank 0 never
                # joins): the world cannot run again, whatever the error was
                raise c.fail(c.dead_rank() or f"the step failed on rank 0: {type(exc).__name__}: {exc}") from exc
            c.last = time.monotonic()
        results: dict[int, SampleResult | BaseException] = dict(out)
        if 0 in parts:  # outside the world: a sampling error fails this step's requests, not the ranks
            try:
                results[0] = parts[0][1].run(logits if logits is not None else torch.empty(0, self.vocab_size), self.forward.sampler)
            except Exception as exc:  # noqa: BLE001 - group 0's requests fail; the world goes on
                results[0] = exc
        return results

    def _run_world(self, payload: torch.Tensor, full: list[StepPart | None], decode: bool) -> tuple[dict[int, SampleResult], torch.Tensor | None]:
        """Send the step to every rank, run rank 0's forward, take the other
        dp groups' sampled ids and logprobs (holding the control group's
        lock). Returns those and group 0's logits."""
        import torch.distributed as dist

        ctrl, tp = self.control.ctrl, self.layout.tp
        control(torch.tensor([OP_STEP, payload.numel()], dtype=torch.long), ctrl)
        dist.broadcast(payload, src=0, group=ctrl)
        logits = self.forward.run(full[0], decode)
        out: dict[int, SampleResult] = {}
        for d, part in enumerate(full[1:], start=1):
            if part is None:
                continue
            if not part.rows:
                out[d] = SampleResult([], [], [])
                continue
            out[d], nbytes = receive_result(d * tp, ctrl)
            self.result_bytes[d] += nbytes
            self.result_rows[d] += len(part.rows)
        return out, logits

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stop every rank and the watchdog, destroy the process groups (idempotent)."""
        if self._finalizer.detach() is not None:
            self.control.shutdown(timeout)


class StepRounds:
    """With dp > 1: the dp groups' schedulers step on their own threads and
    their parts meet here; a round runs one step of the world with every
    group that arrived, once each group has arrived or finished its step."""

    def __init__(self, world: RankWorld) -> None:
        self._world = weakref.ref(world)  # the world holds its rounds: no cycle to keep it alive
        self._cv = threading.Condition()
        self._pending: dict[int, tuple[StepPart, SampleJob]] = {}
        self._results: dict[int, SampleResult | BaseException] = {}

    def arrive(self, d: int, part: StepPart, job: SampleJob) -> SampleResult | BaseException:
        with self._cv:
            self._pending[d] = (part, job)
            self._cv.notify_all()
            self._cv.wait_for(lambda: d in self._results)
            return self._results.pop(d)

    def drive(self, steps: Sequence[Future[Any]]) -> None:
        """Run rounds until every group's step (``steps[d]``) is done."""
        for f in steps:
            f.add_done_callback(lambda _f: self._notify())
        while True:
            with self._cv:
                self._cv.wait_for(lambda: all(d in self._pending or f.done() for d, f in enumerate(steps)))
                if not self._pending:
                    return
                parts = dict(self._pending)
                self._pending.clear()
            try:
                world = self._world()
                if world is None:
                    raise DeadRankError("the distributed engine is closed")
                results = world.step(parts)
            except BaseException as exc:  # noqa: BLE001 - every group of the round gets it
                results = {d: exc for d in parts}
            with self._cv:
                self._results.update(results)
                self._cv.notify_all()

    def _notify(self) -> None:
        with self._cv:
            self._cv.notify_all()


class MultiprocExecutor(Executor):
    """The executor of one dp group of the world: its batch runs on every
    rank in one step of the world; its rows are sampled where their logits
    are, and only ids and logprobs reach this process."""

    def __init__(self, world: RankWorld, dp_rank: int, *, owns_world: bool) -> None:
        self.world = world
        self.dp_rank = dp_rank
        self.owns_world = owns_world
        self.runner = world.forward.runner  # rank 0's model runner: it builds the batch's metadata
        #: per KV-cache group, page copies applied on every rank of the group before its next forward
        self.copies: list[list[tuple[int, int]]] = [[] for _ in self.runner.kv_groups]

    def execute(self, batch: ScheduledBatch, logit_rows: Sequence[int], job: SampleJob) -> ExecuteOutput:
        ids, meta = self.runner.build_metadata(batch)
        copies, self.copies = self.copies, [[] for _ in self.copies]
        part = StepPart(ids, meta, list(logit_rows), copies)
        return ExecuteOutput(self.world.arrive(self.dp_rank, part, job))

    def copy_pages(self, src: Sequence[Sequence[int]], dst: Sequence[Sequence[int]]) -> None:
        """src[g], dst[g]: the pages of KV-cache group g (copied on every rank with the next step)."""
        for pending, s, d in zip(self.copies, src, dst):
            pending.extend(zip(map(int, s), map(int, d)))

    @property
    def failure(self) -> BaseException | None:
        return self.world.failure

    def describe(self) -> dict[str, Any]:
        layout = self.world.layout
        return {"tp": layout.tp, "dp": layout.dp, "ep": layout.ep}

    def stats(self) -> dict[str, Any]:
        d = self.dp_rank
        return {"world": self.world.layout.world, "rank_result_bytes": self.world.result_bytes[d], "rank_result_rows": self.world.result_rows[d]}

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        if self.owns_world:
            self.world.close(timeout)


def launch_world(config: EngineConfig, registry: PluginRegistry) -> tuple[Started, RankWorld]:
    """Rank 0: launch this node's workers and start as every rank does
    (``start_process``); the world they form."""
    import torch.distributed as dist

    layout = resolve_layout(config)
    check_supported(config, layout)
    p = config.parallel
    if p.node_rank != 0:
        raise ConfigError("only node 0 runs the engine; other nodes run workers (platform serve --node-rank k)")
    port = p.master_port or free_port()
    store = make_store(config, True, port)
    procs = spawn_workers(config, layout, 0, port)

    def alive() -> None:
        for proc in procs:
            if proc.exitcode is not None:
                raise DeadRankError(f"{proc.describe()} during start-up")

    join = RankJoin(config, 0, 0, store, alive)
    try:
        started = start_process(config, registry, join)
    except BaseException:
        stop_workers(procs, kill=True)
        if dist.is_initialized():  # a later engine in this process can form its own world
            dist.destroy_process_group()
        raise
    world = RankWorld(join, started, procs)
    log.info(
        "distributed engine ready: tp=%d dp=%d ep=%d over %d ranks (%s), %s pages per rank",
        layout.tp, layout.dp, layout.ep, layout.world, started.accelerator.dist_backend, "+".join(map(str, started.resolved.num_pages)),
    )  # fmt: skip
    return started, world
