"""The multi-process engine: tp x dp ranks over torch.distributed.

Rank 0 (this process: ``LLM`` or ``platform serve``) runs the API and one
scheduler per dp rank (one ``LLMEngine`` each, behind ``DistributedEngine``,
which hands new requests to the least loaded one). It
launches the other ranks of its node itself as fresh interpreters
(``python -m plinth.engine.worker``; other nodes run ``platform serve
--node-rank k``: workers only). Every rank starts through the one start-up
path (``startup.start_process``, given a ``RankJoin``). Every step it sends each
rank its dp group's batch by one collective on the control group (a header,
then one int64 payload): token ids, positions, sequence and query lengths,
slot mapping, block tables and pending page copies of each KV-cache group,
the logits rows to compute, the group's SampleJob (sampling parameters,
token ids for penalties, grammar masks, the uniforms of seeded rows drawn
on rank 0 from the requests' generators), and the step's decode flag
(decode only when every dp group decodes, so DeepEP's low-latency mode
agrees across the expert group). Every rank runs the same forward; a dp
group with nothing to run does a one-token dummy forward into a scratch
page of each KV-cache group so the expert all-to-all never waits for it.
Rank 0 samples dp group 0; the first tp rank of each other dp group samples
its own rows where its logits are and sends back only the sampled ids and
requested logprobs (``send_result``).

Failure handling: the control group and the model's groups carry a short
collective timeout (``dist_timeout``, 10 s by default); rank 0 sends a
heartbeat (an all-reduce, so a stopped rank is noticed too) every second
while idle, and a watchdog thread polls the local worker processes. A dead or
hung rank turns into ``DeadRankError`` (``fatal``), and so does any failure
once a step went out to the ranks (they are then out of step, whatever the
error was): the engine refuses every later step, the async engine stops (so
``/health`` fails), and the other ranks exit on their own collective error
or timeout. With world = 1 none of this exists: ``factory.build_engine``
never imports this module.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import pickle
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from plinth.api import AttentionMetadata
from plinth.engine.config import EngineConfig
from plinth.engine.engine import LLMEngine
from plinth.engine.grammar import FixedMask
from plinth.engine.interfaces import CLOSE_TIMEOUT_S, EngineCore
from plinth.engine.kv_cache_manager import KVCacheManager, make_group
from plinth.engine.kv_events import build_recorder
from plinth.engine.model_runner import ModelRunner, kv_cache_specs, spec_groups
from plinth.engine.parallel import ParallelGroups, ParallelLayout, init_groups
from plinth.engine.sampler import SampleJob, Sampler, SampleResult, SampleRow, SamplesOnItsRank, random_rows, uniforms
from plinth.engine.scheduler import Scheduler
from plinth.engine.startup import Started, hash_seed, start_process
from plinth.engine.step_plan import plan_step
from plinth.errors import ConfigError, PlinthError
from plinth.plugins import PluginRegistry

log = logging.getLogger("plinth.distributed")

OP_NOOP, OP_STEP, OP_STOP = 0, 1, 2
HEARTBEAT_S = 1.0
#: start-up (imports, weight loading, rendezvous) may take much longer than a step
STARTUP_TIMEOUT_S = float(os.environ.get("PLINTH_DIST_STARTUP_TIMEOUT", "600"))


class DeadRankError(PlinthError):
    """A rank died, hung or failed: the engine cannot step again."""

    fatal = True


# ---- what every rank builds ---------------------------------------------------------------


def resolve_layout(config: EngineConfig) -> ParallelLayout:
    return ParallelLayout.resolve(config.tp, config.dp, config.ep)


def check_supported(config: EngineConfig, layout: ParallelLayout) -> None:
    why = []
    if config.kv_connector:
        why.append("a KV connector (--kv-connector)")
    if config.speculative_method:
        why.append("speculative decoding (--speculative-method)")
    if why:
        raise ConfigError(f"{' and '.join(why)} cannot run with more than one rank yet (tp={layout.tp}, dp={layout.dp}, ep={layout.ep})")
    if config.nnodes < 1 or layout.world % config.nnodes:
        raise ConfigError(f"the world (tp x dp = {layout.world}) does not split evenly over --nnodes {config.nnodes}")
    if not 0 <= config.node_rank < config.nnodes:
        raise ConfigError(f"--node-rank {config.node_rank} is outside 0..{config.nnodes - 1}")
    if config.nnodes > 1 and not (config.master_addr and config.master_port):
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


class RankJoin:
    """A rank's part in ``startup.start_process`` (its ``JoinWorld``): the
    rendezvous, the process group and the TP/DP/EP groups, the cores shared
    by a node's ranks, the smallest KV pool of any rank. Afterwards it holds
    the layout, the groups and the control group."""

    def __init__(self, config: EngineConfig, rank: int, local_rank: int, store: Any, alive: Callable[[], None]) -> None:
        self.config = config
        self.layout = resolve_layout(config)
        self.rank = rank
        self.local_rank = local_rank
        self.store = store
        self.alive = alive
        self.groups: ParallelGroups | None = None
        self.ctrl: Any = None  # the control group (steps, heartbeats, logits back)

    def share_cores(self, options: dict[str, Any]) -> None:
        per_node = self.layout.world // self.config.nnodes
        if per_node > 1 and not os.environ.get("OMP_NUM_THREADS") and not options.get("cpu_threads"):
            # the ranks of a node share its cores: threads each would oversubscribe them
            options["cpu_threads"] = max(1, min(torch.get_num_threads(), (os.cpu_count() or 1) // per_node))
            torch.set_num_threads(options["cpu_threads"])

    def join(self, accelerator: Any) -> ParallelGroups:
        import torch.distributed as dist

        world = self.layout.world
        timeout = datetime.timedelta(seconds=self.config.dist_timeout)
        self.store.set(f"plinth/up/{self.rank}", "1")
        # every rank is up (imports done) before the group forms, whose own timeout is short
        wait_while(lambda: self.store.wait([f"plinth/up/{r}" for r in range(world)]), self.alive, "rendezvous", STARTUP_TIMEOUT_S)
        backend = accelerator.dist_backend  # the accelerator names its collective library
        dist.init_process_group(backend, store=self.store, rank=self.rank, world_size=world, timeout=timeout)
        self.groups = init_groups(self.layout, self.rank, timeout=timeout)
        # steps and heartbeats travel on a host group: torch's gloo is the CPU backend every build has
        self.ctrl = None if backend == "gloo" else dist.new_group(list(range(world)), backend="gloo", timeout=timeout)
        return self.groups

    def agree_num_pages(self, pages: list[int]) -> list[int]:
        # ranks of one node share its memory; after loading, which may take
        # any time: the long-timeout store, not a collective
        self.store.set(f"plinth/pages/{self.rank}", ",".join(map(str, pages)))
        keys = [f"plinth/pages/{r}" for r in range(self.layout.world)]
        wait_while(lambda: self.store.wait(keys), self.alive, "loading the model on every rank", STARTUP_TIMEOUT_S)
        every = [[int(n) for n in self.store.get(k).decode().split(",")] for k in keys]
        return [min(group) for group in zip(*every)]


def make_store(config: EngineConfig, is_master: bool, port: int) -> Any:
    import torch.distributed as dist

    addr = config.master_addr or "127.0.0.1"
    # TCPStore is torch's documented API; its stubs re-export it without saying so
    return dist.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
        addr, port, is_master=is_master, timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S), wait_for_workers=False
    )


# ---- one step's batch as one int64 payload ----------------------------------------------------

#: per dp group: tokens, sequences, logits rows, longest query, bytes of its
#: SampleJob; then per KV-cache group: widest block table, page copies
_HEAD = 5


@dataclass
class StepPart:
    """Dp group d's part of one step, as every rank of the group runs it."""

    ids: torch.Tensor
    #: with more than one KV-cache group, ``meta.groups`` holds each group's block tables and slots
    meta: AttentionMetadata
    #: the flat token rows whose logits the step needs
    rows: list[int]
    #: per KV-cache group, the pages to copy (src, dst) before the forward (n > 1 forks)
    copies: list[list[tuple[int, int]]] = field(default_factory=list)
    #: the encoded SampleJob its first tp rank runs (empty for group 0: rank 0 samples it)
    job: bytes = b""


def group_metas(meta: AttentionMetadata) -> list[AttentionMetadata]:
    return meta.groups or [meta]


def _int64_words(data: bytes) -> np.ndarray:
    return np.frombuffer(data + b"\0" * (-len(data) % 8), dtype=np.int64)


def pack_step(parts: list[StepPart | None], decode: bool, num_groups: int) -> torch.Tensor:
    """parts[d]: dp group d's part, or None (it runs a dummy forward)."""
    head: list[np.ndarray] = [np.array([int(decode)], dtype=np.int64)]
    body: list[np.ndarray] = []
    for part in parts:
        if part is None:
            head.append(np.zeros(_HEAD + 2 * num_groups, dtype=np.int64))
            continue
        m, metas = part.meta, group_metas(part.meta)
        copies = part.copies or [[] for _ in metas]
        head.append(np.array(
            [part.ids.numel(), m.num_seqs, len(part.rows), m.max_query_len, len(part.job),
             *(g.block_tables.shape[1] for g in metas), *(len(c) for c in copies)], dtype=np.int64,
        ))  # fmt: skip
        body += [
            part.ids.cpu().numpy(), m.positions.cpu().numpy(), np.asarray(m.seq_lens_cpu), np.asarray(m.query_lens_cpu),
            np.asarray(part.rows), _int64_words(part.job),
        ]  # fmt: skip
        for g, c in zip(metas, copies):
            body += [g.slot_mapping.cpu().numpy(), g.block_tables.cpu().numpy().ravel(), np.asarray(c).reshape(-1)]
    return torch.from_numpy(np.concatenate([a.astype(np.int64, copy=False) for a in head + body]))


def unpack_step(payload: torch.Tensor, dp: int, dp_rank: int, num_groups: int) -> tuple[bool, list[np.ndarray] | None]:
    """(decode, this group's head and arrays, or None when it has no part)."""
    x = payload.numpy()
    width = _HEAD + 2 * num_groups
    heads = x[1 : 1 + dp * width].reshape(dp, width)
    off = 1 + dp * width
    mine = None
    for d in range(dp):
        t, b, r, _, nbytes = (int(v) for v in heads[d][:_HEAD])
        if t == 0:
            continue
        pages, copies = heads[d][_HEAD : _HEAD + num_groups], heads[d][_HEAD + num_groups :]
        sizes = [t, t, b, b, r, -(-nbytes // 8)] + [n for p, c in zip(pages, copies) for n in (t, b * int(p), 2 * int(c))]
        if d == dp_rank:
            mine = [heads[d]]
            for n in sizes:
                mine.append(x[off : off + n])
                off += n
        else:
            off += sum(sizes)
    return bool(x[0]), mine


def part_from(arrays: list[np.ndarray], runner: ModelRunner, decode: bool) -> StepPart:
    """A worker's StepPart from what ``unpack_step`` cut out for it."""
    head, ids, pos, seq_lens, q_lens, rows, job, *per_group = arrays
    b, dev = int(head[1]), runner.device
    cu = np.zeros(b + 1, dtype=np.int32)
    np.cumsum(q_lens, out=cu[1:])
    shared: dict[str, Any] = dict(
        positions=torch.from_numpy(pos.copy()).to(dev), query_start_loc=torch.from_numpy(cu).to(dev),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev), page_size=runner.page_size,
        max_query_len=int(head[3]), max_seq_len=int(seq_lens.max()), query_lens_cpu=q_lens.tolist(),
        seq_lens_cpu=seq_lens.tolist(), moe_decode=decode,
    )  # fmt: skip
    metas, copies = [], []
    for gi in range(len(per_group) // 3):
        slots, tables, pairs = per_group[3 * gi : 3 * gi + 3]
        table = torch.from_numpy(tables.reshape(b, int(head[_HEAD + gi])).astype(np.int32)).to(dev)
        metas.append(AttentionMetadata(slot_mapping=torch.from_numpy(slots.copy()).to(dev), block_tables=table, **shared))
        copies.append([(int(s), int(d)) for s, d in pairs.reshape(-1, 2)])
    meta = metas[0]
    if len(metas) > 1:
        meta.groups, meta.layer_groups = metas, runner.layer_groups
    return StepPart(torch.from_numpy(ids.copy()).to(dev), meta, rows.tolist(), copies, job.tobytes()[: int(head[4])])


def dummy_step(runner: ModelRunner, scratch: list[int], decode: bool) -> StepPart:
    """One token written into each KV-cache group's scratch page: a dp
    group with no work still joins the expert all-to-all of every MoE layer."""
    dev, ps = runner.device, runner.page_size
    shared: dict[str, Any] = dict(
        positions=torch.zeros(1, dtype=torch.long, device=dev), query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=dev),
        seq_lens=torch.ones(1, dtype=torch.int32, device=dev), page_size=ps, max_query_len=1, max_seq_len=1,
        query_lens_cpu=[1], seq_lens_cpu=[1], moe_decode=decode,
    )  # fmt: skip
    metas = [
        AttentionMetadata(
            slot_mapping=torch.full((1,), page * ps, dtype=torch.long, device=dev),
            block_tables=torch.full((1, 1), page, dtype=torch.int32, device=dev), **shared,
        )
        for page in scratch
    ]  # fmt: skip
    meta = metas[0]
    if len(metas) > 1:
        meta.groups, meta.layer_groups = metas, runner.layer_groups
    return StepPart(torch.zeros(1, dtype=torch.long, device=dev), meta, [])


# ---- a dp group's sampling on its own rank ---------------------------------------------------


def encode_job(job: SampleJob, vocab: int) -> bytes:
    """A dp group's SampleJob for its rank: each row's parameters and token
    ids, a grammar as its mask (bits) and the uniforms of the random rows,
    drawn here from the requests' generators in the order one process draws
    them (a seeded request samples the same tokens at any dp)."""
    rand = random_rows(job.rows)
    u = uniforms([job.rows[i].generator for i in rand]).tolist() if rand else []
    rows = [
        (r.params.clone(grammar=None), list(r.prompt_ids), list(r.output_ids), list(r.banned),
         None if r.grammar is None else np.packbits(FixedMask.of(r.grammar, vocab).forbidden.cpu().numpy()).tobytes())
        for r in job.rows
    ]  # fmt: skip
    return pickle.dumps((rows, job.at, job.prompt, u), protocol=pickle.HIGHEST_PROTOCOL)


def decode_job(data: bytes, vocab: int) -> SampleJob:
    wire, at, prompt, u = pickle.loads(data)
    rows = [
        SampleRow(
            params=params, prompt_ids=prompt_ids, output_ids=output_ids, generator=None, banned=banned,
            grammar=None if bits is None else FixedMask(torch.from_numpy(np.unpackbits(np.frombuffer(bits, dtype=np.uint8))[:vocab].astype(bool))),
        )
        for params, prompt_ids, output_ids, banned, bits in wire
    ]  # fmt: skip
    return SampleJob(rows, at, prompt, torch.tensor(u, dtype=torch.float64) if u else None)


def send_result(result: SampleResult, ctrl: Any) -> None:
    """To rank 0: the byte count, then the pickled SampleResult (ids and logprobs)."""
    import torch.distributed as dist

    data = pickle.dumps((result.tokens, result.logprobs, result.prompt_logprobs), protocol=pickle.HIGHEST_PROTOCOL)
    dist.send(torch.tensor([len(data)], dtype=torch.long), dst=0, group=ctrl)
    dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst=0, group=ctrl)


def receive_result(src: int, ctrl: Any) -> tuple[SampleResult, int]:
    """(what ``send_result`` sent from rank src, the bytes that crossed)."""
    import torch.distributed as dist

    n = torch.zeros(1, dtype=torch.long)
    dist.recv(n, src=src, group=ctrl)
    data = torch.empty(int(n[0]), dtype=torch.uint8)
    dist.recv(data, src=src, group=ctrl)
    return SampleResult(*pickle.loads(data.numpy().tobytes())), n.element_size() + data.numel()


class RankForward:
    """The forward every rank runs on its dp group's part of a step: a
    ModelRunner over the agreed pool and one scratch page per KV-cache
    group (the last) for dummy forwards."""

    def __init__(self, config: EngineConfig, started: Started) -> None:
        pages = started.plan.pages
        self.runner = ModelRunner(
            started.model, started.attention, started.model_cfg, device=started.device, dtype=started.dtype,
            num_pages=[n + 1 for n in pages], page_size=config.page_size,
        )  # fmt: skip
        self.scratch = list(pages)
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


def control(header: torch.Tensor, ctrl: Any) -> None:
    """The header all-reduce (MAX: workers give zeros): unlike a broadcast,
    the sender waits for every rank, so a stopped rank is noticed too."""
    import torch.distributed as dist

    dist.all_reduce(header, op=dist.ReduceOp.MAX, group=ctrl)


# ---- rank 0 --------------------------------------------------------------------------------


class _GroupRunner(SamplesOnItsRank):
    """The ``runner`` of dp group d's ``LLMEngine`` on rank 0: it hands the
    batch and its SampleJob to the front, which runs every group's step at
    once; group d's first rank samples, and only ids and logprobs come back."""

    def __init__(self, front: "DistributedEngine", dp_rank: int, local: ModelRunner) -> None:
        self.front = front
        self.dp_rank = dp_rank
        self.local = local  # rank 0's ModelRunner (for shapes; group 0 runs on it)
        #: per KV-cache group, page copies applied on every rank of the group before its next forward
        self.copies: list[list[tuple[int, int]]] = [[] for _ in local.kv_groups]

    def execute_sampled(self, batch: Any, logit_rows: Any, job: SampleJob) -> SampleResult:
        ids, meta = self.local.build_metadata(batch)
        return self.front.arrive(self.dp_rank, StepPart(ids, meta, list(logit_rows)), job)

    def copy_pages(self, src: Any, dst: Any) -> None:
        """src[g], dst[g]: the pages of KV-cache group g."""
        for pending, s, d in zip(self.copies, src, dst):
            pending.extend(zip(map(int, s), map(int, d)))

    def take_copies(self) -> list[list[tuple[int, int]]]:
        copies, self.copies = self.copies, [[] for _ in self.copies]
        return copies


class DistributedEngine(EngineCore):
    """Rank 0's engine over tp x dp ranks: one ``LLMEngine`` (scheduler, KV
    pages) per dp group, requests to the least loaded, every step run on all
    ranks at once."""

    def __init__(
        self, config: EngineConfig, started: Started, world: RankJoin, forward: RankForward, procs: list[WorkerProcess], step_plan: Any
    ) -> None:
        self.layout = world.layout
        self.ctrl = world.ctrl
        self.forward = forward
        self.procs = procs  # this node's worker processes
        self.tokenizer = started.tokenizer
        self.model_config = started.model_cfg
        self.max_model_len = started.max_model_len
        self.components = started.components(config, step_plan)
        self.runners = [_GroupRunner(self, d, forward.runner) for d in range(self.layout.dp)]
        self.engines = [
            LLMEngine(
                runner=gr, tokenizer=started.tokenizer, model_config=started.model_cfg,
                scheduler=Scheduler(
                    group_kv(config, started, gr, d), max_num_seqs=config.max_num_seqs,
                    max_num_batched_tokens=step_plan.max_num_batched_tokens,
                ),
                max_model_len=started.max_model_len, components=self.components,
            )
            for d, gr in enumerate(self.runners)
        ]  # fmt: skip
        self.failure: DeadRankError | None = None
        self.owner: dict[str, int] = {}
        #: bytes the other dp groups' ranks sent back (sampled ids and logprobs: never logits)
        self.rank_result_bytes = 0
        self.rank_result_rows = 0
        self._lock = threading.Lock()  # the control group: steps and heartbeats in one order
        self._last = time.monotonic()
        self._closed = False
        self._cv = threading.Condition()
        self._pending: dict[int, tuple[StepPart, SampleJob]] = {}
        self._results: dict[int, SampleResult | BaseException] = {}
        n = len(self.engines)
        self._pool = ThreadPoolExecutor(n, thread_name_prefix="plinth-dp") if n > 1 else None
        self._stop = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="plinth-watchdog", daemon=True)
        self._watchdog.start()
        atexit.register(self.close)

    # ---- EngineCore -------------------------------------------------------------------------

    @property
    def requests(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for e in self.engines:
            out.update(e.requests)
        return out

    def validate(self, prompt_token_ids: Any, params: Any) -> None:
        self.engines[0].validate(prompt_token_ids, params)

    def add_request(self, request_id: str, prompt_token_ids: Any, params: Any, *, prompt: str | None = None) -> Any:
        self.check()
        if request_id in self.owner:
            return self.engines[self.owner[request_id]].add_request(request_id, prompt_token_ids, params, prompt=prompt)
        d = min(range(len(self.engines)), key=lambda i: (len(self.engines[i].requests), i))
        req = self.engines[d].add_request(request_id, prompt_token_ids, params, prompt=prompt)
        self.owner[request_id] = d
        return req

    def abort_request(self, request_id: str) -> Any:
        d = self.owner.pop(request_id, None)
        return None if d is None else self.engines[d].abort_request(request_id)

    def has_unfinished(self) -> bool:
        # a failure is reported by the next step, even with nothing in flight
        return self.failure is not None or any(e.has_unfinished() for e in self.engines)

    def unfinished_request_ids(self) -> list[str]:
        return [rid for e in self.engines for rid in e.unfinished_request_ids()]

    def num_waiting(self) -> int:
        return sum(e.num_waiting() for e in self.engines)

    def describe(self) -> dict[str, Any]:
        return {**self.components.describe(), "tp": self.layout.tp, "dp": self.layout.dp, "ep": self.layout.ep}

    def kv_transfer(self) -> Any:
        return None  # check_supported refuses a KV connector with more than one rank

    def stats(self) -> dict[str, Any]:
        total: dict[str, Any] = {}
        for e in self.engines:
            for k, v in e.stats().items():
                total[k] = total.get(k, 0) + v if isinstance(v, (int, float)) else v
        total["world"] = self.layout.world
        total["rank_result_bytes"] = self.rank_result_bytes
        total["rank_result_rows"] = self.rank_result_rows
        return total

    def pages_held(self) -> int:
        return sum(e.pages_held() for e in self.engines)

    def check(self) -> None:
        if self.failure is not None:
            raise self.failure

    # ---- steps ----------------------------------------------------------------------------

    def step(self) -> list[Any]:
        self.check()
        try:
            if self._pool is None:
                outputs = self.engines[0].step()
            else:
                outputs = self._step_groups()
        except DeadRankError:
            raise
        except Exception as exc:
            if self.failure is not None:  # the world broke (_global_step): every later step refuses
                raise self.failure from exc
            raise  # the scheduler or sampler on rank 0: this step's requests fail, the world goes on
        for out in outputs:
            if out.finished:
                self.owner.pop(out.request_id, None)
        return outputs

    def _step_groups(self) -> list[Any]:
        """Each dp group's engine steps on its own thread; their forwards meet
        in rounds, where groups with nothing to run do dummy forwards."""
        futures = [self._pool.submit(e.step) for e in self.engines]
        for f in futures:
            f.add_done_callback(lambda _f: self._notify())
        while True:
            with self._cv:
                self._cv.wait_for(lambda: all(d in self._pending or f.done() for d, f in enumerate(futures)))
                if not self._pending:
                    break
                parts = dict(self._pending)
                self._pending.clear()
            try:
                results = self._global_step(parts)
            except BaseException as exc:
                results = {d: exc for d in parts}
            with self._cv:
                self._results.update(results)
                self._cv.notify_all()
        outputs: list[Any] = []
        errors = []
        for f in futures:
            try:
                outputs.extend(f.result())
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
        if errors:
            raise errors[0]
        return outputs

    def _notify(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def arrive(self, d: int, part: StepPart, job: SampleJob) -> SampleResult:
        if self._pool is None:
            result = self._global_step({d: (part, job)})[d]
        else:
            with self._cv:
                self._pending[d] = (part, job)
                self._cv.notify_all()
                self._cv.wait_for(lambda: d in self._results)
                result = self._results.pop(d)
        if isinstance(result, BaseException):
            raise result
        return result

    def _global_step(self, parts: dict[int, tuple[StepPart, SampleJob]]) -> dict[int, SampleResult]:
        vocab = self.model_config.vocab_size
        full: list[StepPart | None] = [None] * self.layout.dp
        for d, (part, job) in parts.items():
            part.copies = self.runners[d].take_copies()
            part.job = b"" if d == 0 else encode_job(job, vocab)  # group 0's logits are here
            full[d] = part
        # decode only when every group decodes (a dummy forward is one decode token)
        decode = all(p is None or p.meta.max_query_len == 1 for p in full)
        for p in full:
            for m in group_metas(p.meta) if p is not None else ():
                m.moe_decode = decode
        payload = pack_step(full, decode, self.forward.num_groups)
        with self._lock:
            self.check()
            try:
                out, logits = self._run_world(payload, full, decode)
            except BaseException as exc:
                # once a step started on every rank, any failure leaves the
                # ranks out of step (some wait in a collective rank 0 never
                # joins): the world cannot run again, whatever the error was
                raise self._fail(self._dead_rank() or f"the step failed on rank 0: {type(exc).__name__}: {exc}") from exc
            self._last = time.monotonic()
        if 0 in parts:  # outside the world: a sampling error fails this step's requests, not the ranks
            out[0] = parts[0][1].run(logits if logits is not None else torch.empty(0, vocab), self.forward.sampler)
        return out

    def _run_world(self, payload: torch.Tensor, full: list[StepPart | None], decode: bool) -> tuple[dict[int, SampleResult], torch.Tensor | None]:
        """Send the step to every rank, run rank 0's forward, take the other
        dp groups' sampled ids and logprobs (holding the control group's
        lock). Returns those and group 0's logits."""
        import torch.distributed as dist

        tp = self.layout.tp
        control(torch.tensor([OP_STEP, payload.numel()], dtype=torch.long), self.ctrl)
        dist.broadcast(payload, src=0, group=self.ctrl)
        logits = self.forward.run(full[0], decode)
        out: dict[int, SampleResult] = {}
        for d, part in enumerate(full[1:], start=1):
            if part is None:
                continue
            if not part.rows:
                out[d] = SampleResult([], [], [])
                continue
            out[d], nbytes = receive_result(d * tp, self.ctrl)
            self.rank_result_bytes += nbytes
            self.rank_result_rows += len(part.rows)
        return out, logits

    # ---- failure handling and shutdown ----------------------------------------------------

    def _fail(self, why: str) -> DeadRankError:
        """The world is broken: kill this node's ranks; the failure every later step raises."""
        if self.failure is None:
            self.failure = DeadRankError(f"the distributed engine failed: {why}; restart it")
            log.error("%s", self.failure)
        stop_workers(self.procs, kill=True)
        return self.failure

    def _dead_rank(self, wait: float = 1.0) -> str | None:
        """Which local worker died (a broken collective is usually the first sign)."""
        deadline = time.monotonic() + wait
        while True:
            for p in self.procs:
                if p.exitcode is not None:
                    return p.describe()
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)

    def _watch(self) -> None:
        """Poll this node's workers; heartbeat while idle."""
        while not self._stop.is_set():
            self._stop.wait(0.2)
            if self._stop.is_set() or self.failure is not None:
                return
            for p in self.procs:
                if p.exitcode is not None:
                    self._fail(p.describe())
                    return
            if time.monotonic() - self._last > HEARTBEAT_S and self._lock.acquire(blocking=False):
                try:
                    if self.failure is None and not self._closed:
                        control(torch.tensor([OP_NOOP, 0], dtype=torch.long), self.ctrl)
                        self._last = time.monotonic()
                except Exception as exc:  # noqa: BLE001 - any heartbeat failure: a dead or hung rank
                    self._fail(self._dead_rank() or f"the heartbeat failed: {type(exc).__name__}: {exc}")
                finally:
                    self._lock.release()

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Take no new request, stop every rank (a STOP step when they are
        healthy, else kill this node's), stop the watchdog and dp threads."""
        if self._closed:
            return
        self._closed = True
        bound = time.monotonic() + timeout
        for e in self.engines:
            e.close(max(0.0, bound - time.monotonic()))
        self._stop.set()
        import torch.distributed as dist

        if self.failure is None and self._lock.acquire(timeout=max(0.0, bound - time.monotonic())):
            try:
                control(torch.tensor([OP_STOP, 0], dtype=torch.long), self.ctrl)
            except Exception as exc:  # noqa: BLE001 - stopping anyway
                log.warning("stopping the ranks: %s", exc)
            finally:
                self._lock.release()
        stop_workers(self.procs, kill=self.failure is not None, timeout=max(1.0, bound - time.monotonic()))
        self._watchdog.join(max(0.0, bound - time.monotonic()))
        if self._pool is not None:  # its threads are idle unless a step hangs: joined up to the bound
            self._pool.shutdown(wait=False, cancel_futures=True)
            for t in threading.enumerate():
                if t.name.startswith("plinth-dp_"):
                    t.join(max(0.0, bound - time.monotonic()))
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001
            log.debug("destroy_process_group: %s", exc)
        atexit.unregister(self.close)


def group_kv(config: EngineConfig, started: Started, runner: _GroupRunner, dp_rank: int) -> KVCacheManager:
    """Dp group d's KV-cache manager: its own pages, the pool every rank agreed on."""
    kv = KVCacheManager(
        [make_group(spec, layers, pages, config.page_size, enable_caching=config.enable_prefix_caching)
         for (spec, layers), pages in zip(spec_groups(kv_cache_specs(started.model)), started.plan.pages)],
        hash_seed=hash_seed(started.source, started.model_cfg),
        copy_pages=runner.copy_pages,
    )  # fmt: skip
    kv.pool.events = build_recorder(config.kv_events_config, block_size=config.page_size, dp_rank=dp_rank)
    return kv


def build_distributed_engine(config: EngineConfig, registry: PluginRegistry) -> DistributedEngine:
    """Rank 0: launch this node's workers, start as every rank does
    (``start_process``), and build one engine per dp group."""
    layout = resolve_layout(config)
    check_supported(config, layout)
    if config.node_rank != 0:
        raise ConfigError("only node 0 runs the engine; other nodes run workers (platform serve --node-rank k)")
    port = config.master_port or free_port()
    store = make_store(config, True, port)
    procs = spawn_workers(config, layout, 0, port)

    def alive() -> None:
        for p in procs:
            if p.exitcode is not None:
                raise DeadRankError(f"{p.describe()} during start-up")

    world = RankJoin(config, 0, 0, store, alive)
    try:
        started = start_process(config, registry, world)
        forward = RankForward(config, started)
    except BaseException:
        stop_workers(procs, kill=True)
        raise
    # every rank runs every forward together, so no probe runs here: the default budget
    step_plan = plan_step(config, max_model_len=started.max_model_len, distributed=True)
    log.info("%s", step_plan.log_line())
    engine = DistributedEngine(config, started, world, forward, procs, step_plan)
    log.info("distributed engine ready: tp=%d dp=%d ep=%d over %d ranks (%s), %d pages per rank",
             layout.tp, layout.dp, layout.ep, layout.world, started.accelerator.dist_backend, started.num_pages)  # fmt: skip
    return engine


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
    per_node = layout.world // config.nnodes
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
