"""The multi-process engine: tp x dp ranks over torch.distributed.

Rank 0 (this process: ``LLM`` or ``platform serve``) runs the API, one
scheduler per dp rank (one ``LLMEngine`` each, behind ``DistributedEngine``,
which hands new requests to the least loaded one) and the sampler. It
launches the other ranks of its node itself (``worker.py``; other nodes run
``platform serve --node-rank k``: workers only) and, every step, sends each
rank its dp group's batch by one collective on the control group (a header,
then one int64 payload): token ids, positions, slot mapping, query starts,
sequence lengths, block tables, the logits rows to compute, pending page
copies, and the step's decode flag (decode only when every dp group decodes,
so DeepEP's low-latency mode agrees across the expert group). Every rank runs
the same forward; a dp group with nothing to run does a one-token dummy
forward into a scratch page so the expert all-to-all never waits for it. The
first tp rank of each other dp group sends its logits rows back to rank 0.

Failure handling: the control group and the model's groups carry a short
collective timeout (``dist_timeout``, 10 s by default); rank 0 sends a
heartbeat (an all-reduce, so a stopped rank is noticed too) every second
while idle, and a watchdog thread polls the local worker processes. A dead or
hung rank turns into ``DeadRankError`` (``fatal``): the engine refuses every
later step, the async engine stops (so ``/health`` fails), and the other
ranks exit on their own collective error or timeout. With world = 1 none of
this exists: ``build_engine`` never imports this module.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from plinth.api import AttentionMetadata, LoadContext, SelectionContext
from plinth.engine.config import EngineConfig
from plinth.engine.kv_events import build_recorder
from plinth.engine.parallel import ParallelGroups, ParallelLayout, init_groups
from plinth.errors import ConfigError, PlinthError, PluginError

log = logging.getLogger("plinth.distributed")

OP_NOOP, OP_STEP, OP_STOP = 0, 1, 2
HEARTBEAT_S = 1.0
#: start-up (imports, weight loading, rendezvous) may take much longer than a step
STARTUP_TIMEOUT_S = float(os.environ.get("PLINTH_DIST_STARTUP_TIMEOUT", "600"))
_FIELDS = 6  # per dp group: tokens, seqs, max pages, rows, copies, max query len


class DeadRankError(PlinthError):
    """A rank died, hung or failed: the engine cannot step again."""

    fatal = True


# ---- what every rank builds ---------------------------------------------------------------


@dataclass
class RankSetup:
    layout: ParallelLayout
    groups: ParallelGroups
    ctrl: Any  # the control group (steps, heartbeats, logits back)
    accelerator: Any
    accelerator_name: str
    backend_name: str
    loader_name: str
    source: Any
    model_cfg: Any
    tokenizer: Any
    model: Any
    ops: Any
    op_sources: dict
    device: torch.device
    dtype: torch.dtype
    num_pages: int
    max_model_len: int


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


def setup_rank(config: EngineConfig, registry: Any, rank: int, local_rank: int, store: Any, alive: Callable[[], None]) -> RankSetup:
    """Everything one rank needs: the process group and the TP/DP/EP groups,
    the plugins (chosen as on one process), the model's shard, the KV pool size
    (the smallest any rank can hold)."""
    import torch.distributed as dist

    from plinth.engine.model_source import locate_model
    from plinth.engine.startup import (
        check_required_ops,
        choose_model_loader,
        kv_pool_pages,
        needs_memory_budget,
        profile_activation_peak,
        profiling_tokens,
        resolve_dtype,
        resolve_ops,
    )  # fmt: skip
    from plinth.plugins import PluginRegistry

    layout = resolve_layout(config)
    registry = registry or PluginRegistry.discover()
    options = dict(config.plugin_options)
    acc_entry = registry.select("accelerator", config.device, SelectionContext(options=options))
    accelerator = acc_entry.load()()
    per_node = layout.world // config.nnodes
    if per_node > 1 and not os.environ.get("OMP_NUM_THREADS") and not options.get("cpu_threads"):
        # the ranks of a node share its cores: threads each would oversubscribe them
        # (set before init_process, so a CPU accelerator binding threads sees the final count)
        options["cpu_threads"] = max(1, min(torch.get_num_threads(), (os.cpu_count() or 1) // per_node))
        torch.set_num_threads(options["cpu_threads"])
    accelerator.init_process(local_rank=local_rank, options=options)
    timeout = datetime.timedelta(seconds=config.dist_timeout)
    store.set(f"plinth/up/{rank}", "1")
    # every rank is up (imports done) before the group forms, whose own timeout is short
    wait_while(lambda: store.wait([f"plinth/up/{r}" for r in range(layout.world)]), alive, "rendezvous", STARTUP_TIMEOUT_S)
    backend = accelerator.dist_backend  # the accelerator names its collective library
    dist.init_process_group(backend, store=store, rank=rank, world_size=layout.world, timeout=timeout)
    groups = init_groups(layout, rank, timeout=timeout)
    # steps and heartbeats travel on a host group: torch's gloo is the CPU backend every build has
    ctrl = None if backend == "gloo" else dist.new_group(list(range(layout.world)), backend="gloo", timeout=timeout)
    torch.manual_seed(config.seed)
    device = accelerator.device(local_rank)
    dtype = resolve_dtype(config.dtype, accelerator)
    source = locate_model(config.model)
    ctx = SelectionContext(accelerator=accelerator, dtype=dtype, options=options, tp=config.tp, ep=config.ep)
    loader_entry = choose_model_loader(registry, source, ctx)
    loader = loader_entry.load()()
    model_cfg = loader.load_config(source)
    max_model_len = min(config.max_model_len or model_cfg.max_model_len, model_cfg.max_model_len)
    ctx.model = model_cfg
    backend_entry = registry.select("backend", config.backend, ctx, prefer=accelerator.info().preferred_backends)
    ops, op_sources = resolve_ops(registry, backend_entry, ctx)
    tried = [backend_entry.name] + [e.name for e in registry.entries["backend"] if e.descriptor.reference and e is not backend_entry]
    check_required_ops(loader.required_ops(model_cfg), ops, tried, model_cfg.architecture)
    a2a, a2a_bytes = build_a2a(config, registry, ctx, groups, model_cfg, rank) if layout.ep > 1 else (None, 0)
    tokenizer = loader.load_tokenizer(source) if rank == 0 else None
    load_ctx = LoadContext(
        device=device, dtype=dtype, ops=ops, progress=config.load_progress and rank == 0,
        tp_rank=groups.tp_rank, tp_size=layout.tp, tp_group=groups.tp_group,
        ep_rank=groups.ep_rank, ep_size=layout.ep, ep_group=groups.ep_group, a2a=a2a, dequantize=config.dequantize,
    )  # fmt: skip
    model = loader.load_model(source, model_cfg, load_ctx)
    peak = 0
    if needs_memory_budget(config):  # every rank together: the forward's collectives
        peak = profile_activation_peak(
            accelerator, model, ops, model_cfg, device=device, dtype=dtype, page_size=config.page_size,
            tokens=profiling_tokens(config, max_model_len), device_index=local_rank,
        )  # fmt: skip
    plan = kv_pool_pages(
        config, accelerator, model, dtype, max_model_len=max_model_len, device_index=local_rank, activation_peak=peak,
        reserved=a2a_bytes,
    )  # fmt: skip
    if len(plan.pages) > 1:  # the step payload carries one block table per sequence
        raise ConfigError(f"{model_cfg.architecture}: a model with {len(plan.pages)} KV-cache groups (sliding-window layers) runs in one process only, for now")
    num_pages, page_bytes = plan.pages[0], plan.page_bytes[0]
    # the smallest pool any rank can hold (ranks of one node share its memory); after
    # loading, which may take any time: the long-timeout store, not a collective
    store.set(f"plinth/pages/{rank}", str(int(num_pages)))
    keys = [f"plinth/pages/{r}" for r in range(layout.world)]
    wait_while(lambda: store.wait(keys), alive, "loading the model on every rank", STARTUP_TIMEOUT_S)
    num_pages = min(int(store.get(k)) for k in keys)
    if num_pages < 1:
        raise ConfigError(f"no memory left for the KV cache on some rank (one page takes {page_bytes} bytes)")
    return RankSetup(
        layout, groups, ctrl, accelerator, acc_entry.name, backend_entry.name, loader_entry.name, source, model_cfg,
        tokenizer, model, ops, op_sources, device, dtype, int(num_pages), max_model_len,
    )


def build_a2a(config: EngineConfig, registry: Any, ctx: SelectionContext, groups: ParallelGroups, model_cfg: Any, rank: int) -> tuple[Any, int]:
    """This rank's a2a plugin and the device bytes of its buffers, allocated
    now (every rank together), before the weights load and the KV pool is
    sized. The launcher judged the planned layout and named the plugin
    (``startup.choose_a2a``); a node started alone (``run_node``) with
    ``--a2a auto`` judges the same plan here."""
    from plinth.engine.startup import planned_layout

    ctx = dataclasses.replace(ctx, layout=planned_layout(config, registry))
    entry = registry.get("a2a", config.a2a) if config.a2a != "auto" else registry.select("a2a", "auto", ctx)
    a2a = entry.load()(ctx, group=groups.ep_group, num_experts=model_cfg.num_experts, hidden_size=model_cfg.hidden_size)
    try:
        reserved = int(a2a.reserve_buffers())
    except Exception as exc:
        raise PluginError(f"a2a {entry.label()} could not set up its buffers on rank {rank}: {type(exc).__name__}: {exc}") from exc
    if rank == 0:
        log.info("a2a: %s over %d ranks, %.1f MiB of buffers per rank", entry.label(), ctx.layout.ep, reserved / 2**20)
    return a2a, reserved


def make_store(config: EngineConfig, is_master: bool, port: int) -> Any:
    import torch.distributed as dist

    addr = config.master_addr or "127.0.0.1"
    return dist.TCPStore(
        addr, port, is_master=is_master, timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S), wait_for_workers=False
    )


# ---- one step's batch as one int64 payload ----------------------------------------------------


def pack_step(parts: list[tuple[Any, list[int], list[tuple[int, int]]] | None], decode: bool) -> torch.Tensor:
    """parts[d]: (input_ids, meta, logit rows, page copies) of dp group d, or None."""
    head: list[np.ndarray] = [np.array([int(decode)], dtype=np.int64)]
    body: list[np.ndarray] = []
    for part in parts:
        if part is None:
            head.append(np.zeros(_FIELDS, dtype=np.int64))
            continue
        ids, meta, rows, copies = part
        tables = meta.block_tables
        head.append(np.array([ids.numel(), meta.num_seqs, tables.shape[1], len(rows), len(copies), meta.max_query_len], dtype=np.int64))
        body += [
            ids.cpu().numpy(), meta.positions.cpu().numpy(), meta.slot_mapping.cpu().numpy(),
            np.asarray(meta.seq_lens_cpu, dtype=np.int64), tables.cpu().numpy().astype(np.int64).ravel(),
            np.asarray(meta.query_lens_cpu, dtype=np.int64), np.asarray(rows, dtype=np.int64),
            np.asarray(copies, dtype=np.int64).reshape(-1),
        ]  # fmt: skip
    return torch.from_numpy(np.concatenate(head + body))


def unpack_step(payload: torch.Tensor, dp: int, dp_rank: int) -> tuple[bool, list[np.ndarray] | None, list[int]]:
    """(decode, this group's arrays or None, every group's row counts)."""
    x = payload.numpy()
    decode = bool(x[0])
    heads = x[1 : 1 + dp * _FIELDS].reshape(dp, _FIELDS)
    off = 1 + dp * _FIELDS
    mine = None
    for d in range(dp):
        t, b, p, r, c, _ = (int(v) for v in heads[d])
        if t == 0:
            continue
        sizes = [t, t, t, b, b * p, b, r, 2 * c]
        if d == dp_rank:
            mine = []
            for n in sizes:
                mine.append(x[off : off + n])
                off += n
            mine.append(heads[d])
        else:
            off += sum(sizes)
    return decode, mine, [int(heads[d][3]) for d in range(dp)]


def metadata_from(arrays: list[np.ndarray], page_size: int, device: torch.device, decode: bool) -> tuple[torch.Tensor, AttentionMetadata, list[int], list[tuple[int, int]]]:
    ids, pos, slots, seq_lens, tables, q_lens, rows, copies, head = arrays
    b, p = int(head[1]), int(head[2])
    cu = np.zeros(b + 1, dtype=np.int32)
    np.cumsum(q_lens, out=cu[1:])
    meta = AttentionMetadata(
        positions=torch.from_numpy(pos.copy()).to(device),
        slot_mapping=torch.from_numpy(slots.copy()).to(device),
        query_start_loc=torch.from_numpy(cu).to(device),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
        block_tables=torch.from_numpy(tables.reshape(b, p).astype(np.int32)).to(device),
        page_size=page_size,
        max_query_len=int(head[5]),
        max_seq_len=int(seq_lens.max()),
        query_lens_cpu=q_lens.tolist(),
        seq_lens_cpu=seq_lens.tolist(),
        moe_decode=decode,
    )
    pairs = copies.reshape(-1, 2).tolist()
    return torch.from_numpy(ids.copy()).to(device), meta, rows.tolist(), [tuple(c) for c in pairs]


def dummy_step(scratch_page: int, page_size: int, device: torch.device, decode: bool) -> tuple[torch.Tensor, AttentionMetadata]:
    """One token written into the scratch page: a dp group with no work still
    joins the expert all-to-all of every MoE layer."""
    meta = AttentionMetadata(
        positions=torch.zeros(1, dtype=torch.long, device=device),
        slot_mapping=torch.full((1,), scratch_page * page_size, dtype=torch.long, device=device),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=device),
        seq_lens=torch.ones(1, dtype=torch.int32, device=device),
        block_tables=torch.full((1, 1), scratch_page, dtype=torch.int32, device=device),
        page_size=page_size, max_query_len=1, max_seq_len=1, query_lens_cpu=[1], seq_lens_cpu=[1], moe_decode=decode,
    )  # fmt: skip
    return torch.zeros(1, dtype=torch.long, device=device), meta


class RankForward:
    """The forward every rank runs on its dp group's part of a step."""

    def __init__(self, setup: RankSetup, runner: Any) -> None:
        self.setup = setup
        self.runner = runner  # a ModelRunner over num_pages + 1 pages (the last: scratch)
        self.scratch = setup.num_pages

    @torch.inference_mode()
    def run(self, ids: torch.Tensor | None, meta: AttentionMetadata | None, rows: list[int], copies: list[tuple[int, int]], decode: bool) -> torch.Tensor | None:
        r = self.runner
        if copies:
            src, dst = zip(*copies)
            r.ops.copy_pages(r.kv_caches, torch.tensor(src), torch.tensor(dst))
        if ids is None:
            ids, meta = dummy_step(self.scratch, r.page_size, r.device, decode)
        r.ops.prepare_attention(meta)
        hidden = r.model(ids, meta.positions, r.kv_caches, meta)
        if not rows:
            return None
        idx = torch.tensor(rows, dtype=torch.long, device=hidden.device)
        return r.model.compute_logits(hidden.index_select(0, idx)).float().cpu()


def control(header: torch.Tensor, ctrl: Any) -> None:
    """The header all-reduce (MAX: workers give zeros): unlike a broadcast,
    the sender waits for every rank, so a stopped rank is noticed too."""
    import torch.distributed as dist

    dist.all_reduce(header, op=dist.ReduceOp.MAX, group=ctrl)


# ---- rank 0 --------------------------------------------------------------------------------


class _GroupRunner:
    """The ``runner`` of dp group d's ``LLMEngine`` on rank 0: execute hands
    the batch to the front, which runs every group's step at once."""

    def __init__(self, front: "DistributedEngine", dp_rank: int, local: Any) -> None:
        self.front = front
        self.dp_rank = dp_rank
        self.local = local  # rank 0's ModelRunner (for shapes; group 0 runs on it)
        self.copies: list[tuple[int, int]] = []

    def execute(self, batch: Any, logit_rows: Any) -> torch.Tensor:
        ids, meta = self.local.build_metadata(batch)
        return self.front.arrive(self.dp_rank, (ids, meta, list(logit_rows)))

    def copy_pages(self, src: Any, dst: Any) -> None:
        """src[0], dst[0]: the pages of the one KV-cache group ranks support."""
        self.copies.extend(zip(map(int, src[0]), map(int, dst[0])))  # applied on every rank of the group before its next forward


class _Waiting:
    """Requests waiting over every dp group (what the async engine counts)."""

    def __init__(self, engines: list[Any]) -> None:
        self.engines = engines

    @property
    def num_waiting(self) -> int:
        return sum(e.scheduler.num_waiting for e in self.engines)

    @property
    def num_running(self) -> int:
        return sum(e.scheduler.num_running for e in self.engines)


class DistributedEngine:
    """Rank 0's engine over tp x dp ranks: one ``LLMEngine`` (scheduler, KV
    pages) per dp group, requests to the least loaded, every step run on all
    ranks at once. Looks like an ``LLMEngine`` to ``LLM`` and ``AsyncLLM``."""

    def __init__(self, setup: RankSetup, engines: list[Any], runners: list[_GroupRunner], forward: RankForward, procs: list[Any]) -> None:
        self.setup = setup
        self.engines = engines
        self.runners = runners
        self.forward = forward
        self.procs = procs  # this node's worker processes (rank, process)
        self.scheduler = _Waiting(engines)
        self.failure: DeadRankError | None = None
        self.owner: dict[str, int] = {}
        self._lock = threading.Lock()  # the control group: steps and heartbeats in one order
        self._last = time.monotonic()
        self._closed = False
        self._cv = threading.Condition()
        self._pending: dict[int, Any] = {}
        self._results: dict[int, Any] = {}
        self._pool = ThreadPoolExecutor(len(engines), thread_name_prefix="plinth-dp") if len(engines) > 1 else None
        self._stop = threading.Event()
        threading.Thread(target=self._watch, name="plinth-watchdog", daemon=True).start()
        atexit.register(self.close)

    # ---- what LLM, AsyncLLM and the server read ------------------------------------------

    def __getattr__(self, name: str) -> Any:  # tokenizer, model_config, max_model_len, components, eos ids, ...
        if name in ("engines", "setup"):
            raise AttributeError(name)
        return getattr(self.engines[0], name)

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

    def stats(self) -> dict[str, Any]:
        total: dict[str, Any] = {}
        for e in self.engines:
            for k, v in e.stats().items():
                total[k] = total.get(k, 0) + v if isinstance(v, (int, float)) else v
        total["world"] = self.setup.layout.world
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
            if self.failure is not None:  # a collective broke because a rank died
                raise self.failure from exc
            if _is_collective_error(exc):
                self._fail(self._dead_rank() or f"a collective failed: {type(exc).__name__}: {exc}")
                raise self.failure from exc
            raise
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

    def arrive(self, d: int, part: Any) -> torch.Tensor:
        if self._pool is None:
            result = self._global_step({d: part})[d]
        else:
            with self._cv:
                self._pending[d] = part
                self._cv.notify_all()
                self._cv.wait_for(lambda: d in self._results)
                result = self._results.pop(d)
        if isinstance(result, BaseException):
            raise result
        return result

    def _global_step(self, parts: dict[int, Any]) -> dict[int, Any]:
        import torch.distributed as dist

        layout = self.setup.layout
        full = []
        for d in range(layout.dp):
            if d in parts:
                ids, meta, rows = parts[d]
                full.append((ids, meta, rows, self.runners[d].copies))
            else:
                full.append(None)
        # decode only when every group decodes (a dummy forward is one decode token)
        decode = all(p is None or p[1].max_query_len == 1 for p in full)
        for p in full:
            if p is not None:
                p[1].moe_decode = decode
        payload = pack_step(full, decode)
        with self._lock:
            self.check()
            control(torch.tensor([OP_STEP, payload.numel()], dtype=torch.long), self.setup.ctrl)
            dist.broadcast(payload, src=0, group=self.setup.ctrl)
            self._last = time.monotonic()
            for d in range(layout.dp):
                self.runners[d].copies = []
            mine = full[0]
            out: dict[int, Any] = {}
            if mine is None:
                self.forward.run(None, None, [], [], decode)
            else:
                out[0] = self.forward.run(mine[0], mine[1], mine[2], mine[3], decode)
            for d in range(1, layout.dp):
                if d in parts:
                    n = len(parts[d][2])
                    logits = torch.empty(n, self.setup.model_cfg.vocab_size)
                    if n:
                        dist.recv(logits, src=d * layout.tp, group=self.setup.ctrl)
                    out[d] = logits
            self._last = time.monotonic()
        if 0 in out and out[0] is None:
            out[0] = torch.empty(0, self.setup.model_cfg.vocab_size)
        return out

    # ---- failure handling and shutdown ----------------------------------------------------

    def _fail(self, why: str) -> None:
        if self.failure is None:
            self.failure = DeadRankError(f"the distributed engine failed: {why}; restart it")
            log.error("%s", self.failure)
        self._stop_workers(kill=True)

    def _dead_rank(self, wait: float = 1.0) -> str | None:
        """Which local worker died (a broken collective is usually the first sign)."""
        deadline = time.monotonic() + wait
        while True:
            for rank, p in self.procs:
                if p.exitcode is not None:
                    return f"rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)

    def _watch(self) -> None:
        """Poll this node's workers; heartbeat while idle."""
        while not self._stop.is_set():
            self._stop.wait(0.2)
            if self._stop.is_set() or self.failure is not None:
                return
            for rank, p in self.procs:
                if p.exitcode is not None:
                    self._fail(f"rank {rank} (pid {p.pid}) exited with code {p.exitcode}")
                    return
            if time.monotonic() - self._last > HEARTBEAT_S and self._lock.acquire(blocking=False):
                try:
                    if self.failure is None and not self._closed:
                        control(torch.tensor([OP_NOOP, 0], dtype=torch.long), self.setup.ctrl)
                        self._last = time.monotonic()
                except Exception as exc:  # noqa: BLE001 - a dead or hung rank
                    self._fail(self._dead_rank() or f"the heartbeat failed: {type(exc).__name__}: {exc}")
                finally:
                    self._lock.release()

    def _stop_workers(self, kill: bool) -> None:
        for _, p in self.procs:
            if kill and p.exitcode is None:
                p.kill()
        for _, p in self.procs:
            p.join(5)
            if p.exitcode is None:
                p.kill()
                p.join(5)

    def close(self) -> None:
        """Stop every rank (a STOP step when they are healthy, else kill this node's)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        import torch.distributed as dist

        if self.failure is None and self._lock.acquire(timeout=30):
            try:
                control(torch.tensor([OP_STOP, 0], dtype=torch.long), self.setup.ctrl)
            except Exception as exc:  # noqa: BLE001
                log.warning("stopping the ranks: %s", exc)
            finally:
                self._lock.release()
        self._stop_workers(kill=self.failure is not None)
        for e in self.engines:
            e.kv.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001
            log.debug("destroy_process_group: %s", exc)
        atexit.unregister(self.close)

    shutdown = close


def _is_collective_error(exc: BaseException) -> bool:
    name = type(exc).__name__
    return name in ("DistBackendError", "DistNetworkError", "DistStoreError") or "gloo" in str(exc).lower() or "timed out" in str(exc).lower()


def build_distributed_engine(config: EngineConfig, registry: Any = None) -> DistributedEngine:
    """Rank 0: launch this node's workers, set up, and build one engine per dp group."""

    from plinth.engine.engine import LLMEngine
    from plinth.engine.kv_cache_manager import KVCacheManager, make_group
    from plinth.engine.model_runner import ModelRunner, kv_cache_specs, spec_groups
    from plinth.engine.scheduler import Scheduler
    from plinth.engine.startup import Components, _hash_seed
    from plinth.engine.step_plan import plan_step

    layout = resolve_layout(config)
    check_supported(config, layout)
    if config.node_rank != 0:
        raise ConfigError("only node 0 runs the engine; other nodes run workers (run_node)")
    port = config.master_port or free_port()
    store = make_store(config, True, port)
    procs = spawn_workers(config, layout, 0, port)

    def alive() -> None:
        for rank, p in procs:
            if p.exitcode is not None:
                raise DeadRankError(f"rank {rank} (pid {p.pid}) exited with code {p.exitcode} during start-up")

    try:
        setup = setup_rank(config, registry, 0, 0, store, alive)
        runner = ModelRunner(
            setup.model, setup.ops, setup.model_cfg, device=setup.device, dtype=setup.dtype,
            num_pages=setup.num_pages + 1, page_size=config.page_size,
        )  # fmt: skip
    except BaseException:
        for _, p in procs:
            p.kill()
            p.join(5)
        raise
    forward = RankForward(setup, runner)
    # every rank runs every forward together, so no probe runs here: the default budget
    step_plan = plan_step(config, max_model_len=setup.max_model_len, distributed=True)
    log.info("%s", step_plan.log_line())
    components = Components(
        config=config, accelerator=setup.accelerator, accelerator_name=setup.accelerator_name, backend_name=setup.backend_name,
        model_loader_name=setup.loader_name, source=setup.source, model_config=setup.model_cfg, dtype=setup.dtype,
        device=setup.device, ops=setup.ops, op_sources=setup.op_sources, num_pages=setup.num_pages,
        step_plan=step_plan,
    )  # fmt: skip
    engines, runners = [], []
    front = DistributedEngine.__new__(DistributedEngine)
    for d in range(layout.dp):
        gr = _GroupRunner(front, d, runner)
        kv = KVCacheManager(
            [make_group(spec, layers, setup.num_pages, config.page_size, enable_caching=config.enable_prefix_caching)
             for spec, layers in spec_groups(kv_cache_specs(setup.model))],  # fmt: skip
            hash_seed=_hash_seed(setup.source, setup.model_cfg),
            copy_pages=gr.copy_pages,
        )
        kv.pool.events = build_recorder(config.kv_events_config, block_size=config.page_size, dp_rank=d)
        sched = Scheduler(kv, max_num_seqs=config.max_num_seqs, max_num_batched_tokens=step_plan.max_num_batched_tokens)
        engines.append(
            LLMEngine(runner=gr, tokenizer=setup.tokenizer, model_config=setup.model_cfg, scheduler=sched,
                      max_model_len=setup.max_model_len, components=components)  # fmt: skip
        )
        runners.append(gr)
    DistributedEngine.__init__(front, setup, engines, runners, forward, procs)
    log.info("distributed engine ready: tp=%d dp=%d ep=%d over %d ranks (%s), %d pages per rank",
             layout.tp, layout.dp, layout.ep, layout.world, setup.accelerator.dist_backend, setup.num_pages)  # fmt: skip
    return front


def spawn_workers(config: EngineConfig, layout: ParallelLayout, node_rank: int, port: int, skip_first: bool = True) -> list[tuple[int, Any]]:
    import multiprocessing as mp

    per_node = layout.world // config.nnodes
    first = node_rank * per_node
    ctx = mp.get_context("spawn")
    procs = []
    for local in range(1 if skip_first else 0, per_node):
        rank = first + local
        p = ctx.Process(target=_worker_entry, args=(config, rank, local, port), name=f"plinth-rank{rank}", daemon=True)
        p.start()
        procs.append((rank, p))
    return procs


def _worker_entry(config: EngineConfig, rank: int, local_rank: int, port: int) -> None:
    from plinth.engine.worker import worker_main

    worker_main(config, rank, local_rank, port)


def run_node(config: EngineConfig) -> int:
    """A node other than 0 (``--node-rank k``): run its ranks until rank 0 stops them."""
    from plinth.engine.worker import worker_main

    layout = resolve_layout(config)
    check_supported(config, layout)
    per_node = layout.world // config.nnodes
    procs = spawn_workers(config, layout, config.node_rank, int(config.master_port), skip_first=True)
    try:
        return worker_main(config, config.node_rank * per_node, 0, int(config.master_port))
    finally:
        for _, p in procs:
            p.join(10)
            if p.exitcode is None:
                p.kill()
