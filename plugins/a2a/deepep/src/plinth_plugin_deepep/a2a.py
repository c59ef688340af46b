"""MoE dispatch/combine with DeepEP (https://github.com/deepseek-ai/DeepEP),
both generations DeepEP 2.1 ships, written against its current source
(``deep_ep/buffers/legacy.py``, ``deep_ep/buffers/elastic.py``,
``csrc/legacy/buffer.hpp``, ``csrc/elastic/buffer.hpp``,
``csrc/kernels/legacy/internode_ll.cu``):

legacy ``deep_ep.Buffer``
    One Buffer per process, made with ``low_latency_mode`` when decode steps
    take the low-latency kernels (NVSHMEM is initialised once per process:
    a second Buffer's init fails across nodes; SGLang keeps one too).
    Prefill / mixed steps: ``get_dispatch_layout`` then ``dispatch`` (normal
    kernels; its receive count is the one host sync of the layer) -> the
    received tokens with local top-k ids and weights ("flat" layout; the
    experts apply the weights), ``combine`` sums them back. Decode-only
    steps (at most ``max_num_seqs`` tokens on a rank): ``low_latency_dispatch``
    -> a padded per-expert tensor with counts on the device ("padded"
    layout; no host sync), ``low_latency_combine`` applies the weights. The
    low-latency kernels need their part of the buffer zeroed after normal
    kernels ran: ``clean_low_latency_buffer`` before the first low-latency
    step after a normal one.
V2 ``deep_ep.ElasticBuffer``
    ``dispatch`` / ``combine`` with an ``EPHandle`` ("flat" layout; received
    tensors may have slack rows past ``handle.num_recv_tokens``), sized for
    the step token budget per rank: the largest dispatch a step can make.

``check`` judges the planned layout (``ctx.layout``) in the launcher, before
any rank exists, and what DeepEP needs of the host (``host``: its API, one
NCCL, V2's NCCL / torch / GIN, IBGDA for the low-latency kernels); the
buffers are made by ``reserve_buffers`` in every rank at start-up, before
the weights load. deep_ep is imported only when this plugin is constructed,
never by check(). ``auto`` takes V2 only where its prerequisites hold and the
low-latency kernels only where IBGDA does, and says why when it does not.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
from dataclasses import dataclass
from typing import Any

from plinth.api import AllToAll, DispatchedTokens, PluginError, SelectionContext

from plinth_plugin_deepep import host

log = logging.getLogger("plinth.a2a.deepep")

#: ep sizes the legacy normal kernels have a Config for (legacy.py:246-259, `assert num_ranks in config_map`)
LEGACY_RANKS = (2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160)
#: hidden sizes the low-latency kernels are compiled for (csrc/kernels/legacy/launch.cuh:113-133, SWITCH_HIDDEN)
LOW_LATENCY_HIDDEN = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)
#: top-k the low-latency kernels take (internode_ll.cu:493/501 and 1166/1179, kNumMaxTopK = 11)
LOW_LATENCY_MAX_TOPK = 11
#: local experts the legacy normal kernels take (buffer.hpp:469, LEGACY_NUM_MAX_LOCAL_EXPERTS in compiled.cuh:8)
LEGACY_MAX_LOCAL_EXPERTS = 1024
#: NVLink peers per node and RDMA peers (compiled.cuh:5-6; buffer.hpp:113-114)
NVL_PEERS, RDMA_PEERS = 8, 20
#: the devices DeepEP's kernels run on; a test with a fake deep_ep widens it
DEVICE_TYPES = ("cuda",)
#: DeepEP's kernels are built for SM90 (Hopper) and later
MIN_CAPABILITY = (9, 0)


def _deep_ep_version() -> str | None:
    for dist_name in ("deep-ep", "deep_ep"):
        try:
            return importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _major(version: str | None) -> int:
    try:
        return int(str(version).split(".")[0])
    except ValueError:
        return 0


def _capability(text: str) -> tuple[int, int] | None:
    """"sm_90" -> (9, 0); "sm_100" -> (10, 0)."""
    digits = text.removeprefix("sm_")
    if not digits.isdigit() or len(digits) < 2:
        return None
    return int(digits[:-1]), int(digits[-1])


def _generation(options: Any, version: str | None, v2_why: list[str]) -> str:
    """The generation to run: as asked, or (auto) V2 where DeepEP is 2.x and
    V2's prerequisites hold (``v2_why`` empty), else the legacy Buffer."""
    gen = str(options.get("deepep_generation", "auto"))
    if gen == "auto":
        return "v2" if _major(version) >= 2 and not v2_why else "legacy"
    return gen


@dataclass
class HostReport:
    """What the host probes found (``host``), for check() and the ranks."""

    problems: list[str]  # why deep_ep cannot run at all (its API, its NCCL assertion)
    v2_why: list[str]  # why V2 cannot run
    low_latency_why: list[str]  # why the legacy low-latency kernels cannot run (IBGDA)


def agreed_report(mine: HostReport, group: Any) -> HostReport:
    """Every rank's reasons, each once: the ranks must all take the same
    generation and the same kernels (or wait on each other forever), and
    their hosts may differ (nodes)."""
    import torch.distributed as dist

    reports: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(reports, mine, group=group)

    def union(field: str) -> list[str]:
        return list(dict.fromkeys(why for r in reports for why in getattr(r, field)))

    return HostReport(union("problems"), union("v2_why"), union("low_latency_why"))


def host_report(ep: int) -> HostReport:
    pkg = host.package_dir()
    problems = host.api_problems(pkg) if pkg is not None else []
    nccl_why, nccl = host.nccl_problems(pkg)
    return HostReport(problems + nccl_why, host.v2_problems(ep, nccl), host.ibgda_problems())


def _qp_depth() -> int:
    # legacy.py:113: the Buffer keeps NVSHMEM_QP_DEPTH (default 1024) and asserts on it at every low-latency call
    return int(os.environ.get("NVSHMEM_QP_DEPTH", "1024"))


def low_latency_limits(hidden: int, top_k: int, num_experts: int, max_tokens: int) -> list[str]:
    """Why the legacy low-latency kernels cannot run this shape (empty: they can)."""
    why = []
    if hidden and hidden not in LOW_LATENCY_HIDDEN:
        why.append(f"low-latency kernels take hidden sizes {LOW_LATENCY_HIDDEN} (launch.cuh SWITCH_HIDDEN), not {hidden}")
    if top_k > LOW_LATENCY_MAX_TOPK:
        why.append(f"low-latency kernels take top-k <= {LOW_LATENCY_MAX_TOPK} (internode_ll.cu kNumMaxTopK), not {top_k}")
    if num_experts * 4 * 2 > 32 * 1024 * 1024:
        why.append(f"{num_experts} experts overflow the low-latency workspace (internode_ll.cu:506)")
    depth = _qp_depth()
    if depth < 2 * (max_tokens + 1):
        why.append(
            f"NVSHMEM_QP_DEPTH {depth} < 2 x (max tokens per rank {max_tokens} + 1) = {2 * (max_tokens + 1)} "
            "(legacy.py:609): lower --max-num-seqs or raise NVSHMEM_QP_DEPTH"
        )
    return why


@dataclass
class _Handle:
    kind: str  # "normal" | "low_latency" | "v2"
    handle: Any
    dtype: Any
    topk_ids: Any = None
    topk_weights: Any = None
    rows: int = 0  # v2: rows of the received tensor (slack included)


class DeepEPAllToAll(AllToAll):
    @classmethod
    def check(cls, ctx: SelectionContext) -> list[str]:
        reasons = []
        installed = importlib.util.find_spec("deep_ep") is not None
        version = _deep_ep_version()
        if not installed:
            reasons.append(f"deep_ep is not installed ({host.INSTALL_HINT})")
        options = ctx.options
        generation = str(options.get("deepep_generation", "auto"))
        if generation not in ("auto", "legacy", "v2"):
            return reasons + [f"deepep_generation must be auto, legacy or v2, not {generation!r}"]
        if installed and generation == "v2" and version is not None and _major(version) < 2:
            reasons.append(f"deepep_generation=v2 needs DeepEP 2.x (ElasticBuffer); installed: {version}")
        if _low_latency_wanted(options) not in ("auto", "on", "off"):
            reasons.append(f"deepep_low_latency must be auto, on or off, not {options.get('deepep_low_latency')!r}")
        if options.get("deepep_fp8"):
            reasons.append(
                "deepep_fp8 is not offered: no backend here runs an FP8 grouped GEMM on DeepEP's per-128-scaled tokens, "
                "and dequantizing them after the wire would only add work"
            )
        plan = ctx.layout
        if plan is None:  # `platform plugins`: nothing is planned yet
            return reasons
        if plan.device_type not in DEVICE_TYPES:
            reasons.append(f"needs CUDA SM90+ (the planned device is {plan.device_type or 'unknown'})")
        elif plan.device_type == "cuda":
            cap = _capability(plan.capability)
            if cap is None or cap < MIN_CAPABILITY:
                reasons.append(f"needs CUDA SM90+ (this GPU is {plan.capability or 'of unknown capability'})")
        ep, hidden, experts = plan.ep, plan.hidden_size, plan.num_experts
        found = host_report(ep) if installed and plan.device_type in DEVICE_TYPES else HostReport([], [], [])
        reasons += found.problems
        if generation == "v2":
            reasons += found.v2_why
        gen = _generation(options, version, found.v2_why)
        if experts and experts % ep:
            reasons.append(f"{experts} experts do not split over ep {ep} (buffer.hpp: num_experts % num_ranks == 0)")
        if hidden and (hidden * 2) % 16:
            reasons.append(f"hidden {hidden} in bf16 is not a multiple of 16 bytes (buffer.hpp:750, elastic buffer.hpp:755)")
        if gen == "legacy":
            if ep not in LEGACY_RANKS:
                reasons.append(f"the legacy Buffer's normal kernels support ep in {LEGACY_RANKS}, not {ep} (legacy.py:259)")
            if ep >= NVL_PEERS and ep % NVL_PEERS:
                reasons.append(f"ep {ep} is not a multiple of {NVL_PEERS} NVLink peers (buffer.hpp:114)")
            if ep > NVL_PEERS * RDMA_PEERS:
                reasons.append(f"ep {ep} is over {NVL_PEERS} x {RDMA_PEERS} ranks (buffer.hpp:113)")
            if experts and experts // ep > LEGACY_MAX_LOCAL_EXPERTS:
                reasons.append(f"{experts // ep} local experts are over {LEGACY_MAX_LOCAL_EXPERTS} (buffer.hpp:469)")
            if _low_latency_wanted(options) == "on":
                reasons += low_latency_limits(hidden, plan.top_k, experts, plan.max_num_seqs) + found.low_latency_why
        return reasons

    def __init__(self, ctx: SelectionContext, *, group: Any, num_experts: int, hidden_size: int) -> None:
        super().__init__(ctx, group=group, num_experts=num_experts, hidden_size=hidden_size)
        import deep_ep
        import torch.distributed as dist

        plan = ctx.layout
        if plan is None:
            raise PluginError("deepep: built without a planned layout (the engine passes ctx.layout)")
        self.deep_ep = deep_ep
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if num_experts % self.size:
            raise PluginError(f"deepep: {num_experts} experts do not split over {self.size} ranks")
        found = agreed_report(host_report(self.size), group)
        gen = _generation(ctx.options, getattr(deep_ep, "__version__", None) or _deep_ep_version(), found.v2_why)
        if gen == "v2" and not hasattr(deep_ep, "ElasticBuffer"):
            raise PluginError("deepep: V2 (ElasticBuffer) is not in the installed deep_ep")
        if gen == "legacy" and found.v2_why and self.rank == 0:
            log.info("deepep: the legacy Buffer, not V2 (ElasticBuffer): %s", "; ".join(found.v2_why))
        self.generation = gen
        self.num_topk = plan.top_k
        #: the largest dispatch a step can make on a rank (the step token budget): sizes the V2 buffer
        self.max_step_tokens = plan.max_tokens_per_step
        #: the most tokens of a decode-only step on a rank: sizes the low-latency buffer
        self.max_decode_tokens = plan.max_num_seqs
        #: decode steps on the low-latency kernels (legacy only), or the normal ones where the shape rules them out
        why_not = low_latency_limits(hidden_size, plan.top_k, num_experts, plan.max_num_seqs) + found.low_latency_why
        self.low_latency = gen == "legacy" and _low_latency_wanted(ctx.options) != "off" and not why_not
        self.why_not_low_latency = "; ".join(why_not)
        if gen == "legacy" and _low_latency_wanted(ctx.options) == "auto" and why_not and self.rank == 0:
            log.info("deepep: decode steps take the normal kernels, not the low-latency ones: %s", self.why_not_low_latency)
        self._buffer: Any = None
        self._dirty_for_low_latency = False  # normal kernels ran since the low-latency part was last cleaned

    # ---- buffers (collective: every rank makes them together, at start-up) ----------------

    def reserve_buffers(self) -> int:
        deep_ep = self.deep_ep
        if self.generation == "v2":
            # V2 reuses the group's NCCL communicator (deep_ep/utils/comm.py:61-64), which NCCL
            # creates at the group's first collective unless init_process_group had a device_id:
            # before one, _comm_ptr() is 0. One collective makes it, whatever the caller did.
            self._warm_group()
            self._buffer = deep_ep.ElasticBuffer(
                self.group, num_max_tokens_per_rank=self.max_step_tokens, hidden=self.hidden_size, num_topk=self.num_topk,
                use_fp8_dispatch=False,
            )  # fmt: skip
            return int(self._buffer.num_bytes)
        Buffer = deep_ep.Buffer
        hidden_bytes = self.hidden_size * 2  # bf16
        nvl = rdma = 0
        for config in (Buffer.get_dispatch_config(self.size), Buffer.get_combine_config(self.size)):
            nvl = max(nvl, config.get_nvl_buffer_size_hint(hidden_bytes, self.size))
            rdma = max(rdma, config.get_rdma_buffer_size_hint(hidden_bytes, self.size))
        kw: dict[str, Any] = {}
        if self.low_latency:  # one Buffer for both modes: the low-latency part in its RDMA buffer
            rdma = max(rdma, Buffer.get_low_latency_rdma_size_hint(self.max_decode_tokens, self.hidden_size, self.size, self.num_experts))
            # legacy.py Buffer docstring: low-latency mode needs num_qps_per_rank == the local experts
            kw = dict(low_latency_mode=True, num_qps_per_rank=self.num_experts // self.size)
        self._buffer = Buffer(self.group, nvl, rdma, **kw)
        return int(nvl + rdma)

    def _warm_group(self) -> None:
        import torch
        import torch.distributed as dist

        nccl = dist.get_backend(self.group) == "nccl"  # gloo: the fake's CPU tests
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        dist.all_reduce(torch.zeros(1, device=device), group=self.group)

    # ---- dispatch / combine ---------------------------------------------------------------

    def dispatch(self, hidden: Any, topk_ids: Any, topk_weights: Any, *, decode: bool) -> tuple[DispatchedTokens, _Handle]:
        import torch

        if self._buffer is None:
            raise PluginError("deepep: dispatch before reserve_buffers (the engine makes the buffers at start-up)")
        x = hidden.to(torch.bfloat16).contiguous()  # DeepEP's kernels move bf16
        idx = topk_ids.to(torch.int64).contiguous()  # deep_ep.topk_idx_t
        weights = topk_weights.to(torch.float32).contiguous()
        if self.generation == "v2":
            return self._dispatch_v2(x, idx, weights, hidden.dtype, decode)
        if decode and self.low_latency:
            # every rank must take the same kernels or both sides wait forever:
            # the engine agrees on `decode` across ranks, and a decode-only step
            # has at most max_num_seqs tokens on a rank, the low-latency size
            if x.shape[0] > self.max_decode_tokens:
                raise PluginError(
                    f"deepep: a decode step dispatches {x.shape[0]} tokens on this rank, more than the "
                    f"{self.max_decode_tokens} (--max-num-seqs) the low-latency buffer holds"
                )
            if self._dirty_for_low_latency:  # legacy.py:538-550: needed after normal kernels ran
                self._buffer.clean_low_latency_buffer(self.max_decode_tokens, self.hidden_size, self.num_experts)
                self._dirty_for_low_latency = False
            recv, counts, handle, _event, _hook = self._buffer.low_latency_dispatch(
                x, idx, self.max_decode_tokens, self.num_experts, use_fp8=False
            )
            # the experts compute in the model's dtype (a no-op for bf16 models, DeepEP's own)
            return DispatchedTokens("padded", recv.to(hidden.dtype), counts), _Handle("low_latency", handle, hidden.dtype, idx, weights)
        buf = self._buffer
        self._dirty_for_low_latency = self.low_latency
        per_rank, per_rdma_rank, per_expert, in_rank, _event = buf.get_dispatch_layout(idx, self.num_experts)
        recv_x, recv_idx, recv_weights, counts, handle, _event = buf.dispatch(
            x, topk_idx=idx, topk_weights=weights, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        )
        # `counts` is a host list (dispatch waited for it): one copy to the device, no further sync
        counts = torch.tensor(counts, dtype=torch.int64).to(recv_x.device, non_blocking=True)
        return DispatchedTokens("flat", recv_x.to(hidden.dtype), counts, recv_idx, recv_weights), _Handle("normal", handle, hidden.dtype)

    def _dispatch_v2(self, x: Any, idx: Any, weights: Any, dtype: Any, decode: bool) -> tuple[DispatchedTokens, _Handle]:
        import torch

        # a decode step (agreed over the group) has at most max_num_seqs tokens a rank: dispatched
        # with that bound and no host sync; a prefill step syncs, as upstream does by default
        # (elastic.py:961), so that the received tensors are as long as what arrived, not the
        # worst case of the step budget x ranks (elastic buffer.hpp:1058-1064)
        cap = self.max_decode_tokens if decode else self.max_step_tokens
        if x.shape[0] > cap:  # upstream would assert (elastic buffer.hpp:756): say why instead
            what = "decode step" if decode else "step"
            raise PluginError(
                f"deepep: a {what} dispatches {x.shape[0]} tokens on this rank, more than the {cap} "
                f"({'--max-num-seqs' if decode else 'the step token budget'}) the V2 dispatch is bounded by"
            )
        recv_x, recv_idx, recv_weights, handle, _event = self._buffer.dispatch(
            x, topk_idx=idx, topk_weights=weights, num_experts=self.num_experts, num_max_tokens_per_rank=cap,
            do_cpu_sync=not decode,
        )  # fmt: skip
        # per local expert, from the device prefix sum (the host list is empty without a sync)
        psum = handle.psum_num_recv_tokens_per_expert.to(torch.int64)
        counts = torch.diff(psum, prepend=psum.new_zeros(1))
        if decode:
            # rows past the received ones are the worst case's slack, uninitialised: no expert for
            # them (-1) and no weight, read on the device (psum per scaleup rank ends at the total)
            rows = recv_x.shape[0]
            arrived = handle.psum_num_recv_tokens_per_scaleup_rank[-1].to(torch.int64)
            valid = (torch.arange(rows, device=recv_x.device) < arrived).unsqueeze(1)
            got = DispatchedTokens("flat", recv_x.to(dtype), counts, torch.where(valid, recv_idx, -1),
                                   torch.where(valid, recv_weights, 0.0))  # fmt: skip
            return got, _Handle("v2", handle, dtype, rows=rows)
        n = int(handle.num_recv_tokens)  # exact: this dispatch synced with the host
        got = DispatchedTokens("flat", recv_x[:n].to(dtype), counts, recv_idx[:n], recv_weights[:n])
        return got, _Handle("v2", handle, dtype, rows=recv_x.shape[0])

    def combine(self, expert_out: Any, handle: _Handle) -> Any:
        import torch

        y = expert_out.to(torch.bfloat16).contiguous()
        if handle.kind == "low_latency":
            out, _event, _hook = self._buffer.low_latency_combine(y, handle.topk_ids, handle.topk_weights, handle.handle)
        elif handle.kind == "normal":
            out, _weights, _event = self._buffer.combine(y, handle.handle)
        else:
            full = y.new_zeros(handle.rows, y.shape[1])  # the buffer's slack rows carry nothing
            full[: y.shape[0]] = y
            out, _weights, _event = self._buffer.combine(full, handle=handle.handle)
        return out.to(handle.dtype)


def _low_latency_wanted(options: Any) -> str:
    """``deepep_low_latency``: auto (when the shape allows it), on (refuse a shape that does not), off."""
    value = options.get("deepep_low_latency", "auto")
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)
