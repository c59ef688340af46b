"""MoE dispatch/combine with DeepEP (https://github.com/deepseek-ai/DeepEP),
both generations DeepEP 2.x ships, written against its current Python API:

legacy ``deep_ep.Buffer``
    prefill / mixed steps: ``get_dispatch_layout`` then ``dispatch`` (normal
    kernels, NVLink/RDMA buffers sized from ``get_dispatch_config`` /
    ``get_combine_config`` hints) -> the received tokens with local top-k ids
    and weights ("flat" layout; the experts apply the weights), ``combine``
    sums them back. Decode-only steps (at most ``max_tokens_per_rank`` tokens
    on a rank): ``low_latency_dispatch`` -> a padded per-expert tensor with
    counts ("padded" layout; FP8 with per-128 scales when ``deepep_fp8`` is
    set, dequantized here for the experts), ``low_latency_combine`` applies
    the weights. The low-latency buffer is sized by
    ``get_low_latency_rdma_size_hint``.
V2 ``deep_ep.ElasticBuffer``
    ``dispatch`` / ``combine`` with an ``EPHandle`` ("flat" layout; received
    tensors may have slack rows past ``handle.num_recv_tokens``), sized by
    ``get_buffer_size_hint``. A decode step whose routing equals the
    previous one on every rank (agreed by one all-reduce) reuses the cached
    handle (no layout recomputation, no CPU sync).

The generation: ``deepep_generation`` = auto (V2 when installed), legacy or v2.
deep_ep is imported only when this plugin is constructed, never by check().
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass
from typing import Any

from plinth.api import AllToAll, DispatchedTokens, PluginError, SelectionContext

#: ep sizes the legacy normal kernels have a tuned Config for (Buffer.get_dispatch_config)
LEGACY_RANKS = (2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160)


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
            reasons.append("deep_ep is not installed (DeepEP builds from source with CUDA, NCCL and NVSHMEM: pip install deep-ep on the GPU machine)")
        if importlib.util.find_spec("torch") is None:
            return reasons + ["torch is not installed"]
        import torch

        if not torch.cuda.is_available():
            reasons.append("needs CUDA SM90+ (no CUDA device is visible)")
        else:
            major, minor = torch.cuda.get_device_capability()
            if major < 9:
                reasons.append(f"needs CUDA SM90+ (this GPU is sm_{major}{minor})")
        acc = ctx.accelerator
        if acc is not None and getattr(acc, "device_type", "") != "cuda":
            reasons.append(f"needs the cuda accelerator (chosen: {getattr(acc, 'device_type', '?')})")
        generation = str(ctx.options.get("deepep_generation", "auto"))
        if generation not in ("auto", "legacy", "v2"):
            reasons.append(f"deepep_generation must be auto, legacy or v2, not {generation!r}")
        if installed and generation == "v2" and _major(version) < 2:
            reasons.append(f"deepep_generation=v2 needs DeepEP 2.x (ElasticBuffer); installed: {version}")
        legacy = generation == "legacy" or (generation == "auto" and installed and _major(version) < 2)
        if ctx.ep > 1 and legacy and ctx.ep not in LEGACY_RANKS:
            reasons.append(f"the legacy Buffer's normal kernels support ep in {LEGACY_RANKS}, not {ctx.ep}")
        if ctx.ep > 1 and torch.distributed.is_available() and not torch.distributed.is_initialized():
            reasons.append("the torch.distributed world is not set up (the ep group must exist before the buffers)")
        return reasons

    def __init__(self, ctx: SelectionContext, *, group: Any, num_experts: int, hidden_size: int,
                 generation: str | None = None, max_tokens_per_rank: int | None = None, num_topk: int | None = None) -> None:
        super().__init__(ctx, group=group, num_experts=num_experts, hidden_size=hidden_size)
        import deep_ep
        import torch.distributed as dist

        self.deep_ep = deep_ep
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if num_experts % self.size:
            raise ValueError(f"deepep: {num_experts} experts do not split over {self.size} ranks")
        gen = generation or str(ctx.options.get("deepep_generation", "auto"))
        if gen == "auto":
            gen = "v2" if hasattr(deep_ep, "ElasticBuffer") else "legacy"
        if gen == "v2" and not hasattr(deep_ep, "ElasticBuffer"):
            raise ValueError("deepep: V2 (ElasticBuffer) is not in the installed deep_ep")
        self.generation = gen
        #: the most tokens one rank dispatches in a low-latency (decode) step / sizes the V2 buffer
        self.max_tokens = int(max_tokens_per_rank or ctx.options.get("deepep_max_tokens_per_rank", 128))
        self.num_topk = int(num_topk or ctx.options.get("deepep_num_topk", 8))
        self.use_fp8 = bool(ctx.options.get("deepep_fp8", False))
        self._normal = self._low_latency = self._elastic = None
        self._cached: tuple[Any, Any, Any, Any, Any] | None = None  # V2: (ids, weights, handle, recv ids, recv weights)

    # ---- buffers (collective: every rank builds them at the same dispatch) --------------

    def _normal_buffer(self) -> Any:
        if self._normal is None:
            Buffer = self.deep_ep.Buffer
            hidden_bytes = self.hidden_size * 2  # bf16
            nvl = rdma = 0
            for config in (Buffer.get_dispatch_config(self.size), Buffer.get_combine_config(self.size)):
                nvl = max(nvl, config.get_nvl_buffer_size_hint(hidden_bytes, self.size))
                rdma = max(rdma, config.get_rdma_buffer_size_hint(hidden_bytes, self.size))
            self._normal = Buffer(self.group, nvl, rdma)
        return self._normal

    def _low_latency_buffer(self) -> Any:
        if self._low_latency is None:
            Buffer = self.deep_ep.Buffer
            rdma = Buffer.get_low_latency_rdma_size_hint(self.max_tokens, self.hidden_size, self.size, self.num_experts)
            self._low_latency = Buffer(self.group, 0, rdma, low_latency_mode=True, num_qps_per_rank=self.num_experts // self.size)
        return self._low_latency

    def _elastic_buffer(self, num_topk: int) -> Any:
        if self._elastic is None:
            self._elastic = self.deep_ep.ElasticBuffer(
                self.group, num_max_tokens_per_rank=self.max_tokens, hidden=self.hidden_size, num_topk=num_topk,
                use_fp8_dispatch=False,
            )
        return self._elastic

    # ---- dispatch / combine ---------------------------------------------------------------

    def dispatch(self, hidden: Any, topk_ids: Any, topk_weights: Any, *, decode: bool) -> tuple[DispatchedTokens, _Handle]:
        import torch

        x = hidden.to(torch.bfloat16)  # DeepEP's kernels move bf16 (or fp8 with scales)
        idx = topk_ids.to(torch.int64)  # deep_ep.topk_idx_t
        weights = topk_weights.to(torch.float32)
        if self.generation == "v2":
            return self._dispatch_v2(x, idx, weights, decode, hidden.dtype)
        if decode:
            # every rank must take the same kernels or both sides wait forever:
            # the engine agrees on `decode` across ranks, but token counts differ
            # per rank, so a count over the cap is an error here, not a switch
            if x.shape[0] > self.max_tokens:
                raise PluginError(
                    f"deepep: a decode step dispatches {x.shape[0]} tokens on this rank, more than "
                    f"--deepep-max-tokens-per-rank {self.max_tokens}; set it to at least --max-num-seqs"
                )
            buf = self._low_latency_buffer()
            recv, counts, handle, _event, _hook = buf.low_latency_dispatch(
                x, idx, self.max_tokens, self.num_experts, use_fp8=self.use_fp8
            )
            if self.use_fp8:
                recv = _dequantize_per_128(*recv)
            return DispatchedTokens("padded", recv, counts), _Handle("low_latency", handle, hidden.dtype, idx, weights)
        buf = self._normal_buffer()
        per_rank, per_rdma_rank, per_expert, in_rank, _event = buf.get_dispatch_layout(idx, self.num_experts)
        recv_x, recv_idx, recv_weights, counts, handle, _event = buf.dispatch(
            x, topk_idx=idx, topk_weights=weights, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        )
        counts = torch.tensor(counts, dtype=torch.int64, device=recv_x.device)
        return DispatchedTokens("flat", recv_x, counts, recv_idx, recv_weights), _Handle("normal", handle, hidden.dtype)

    def _same_routing_everywhere(self, idx: Any, weights: Any) -> bool:
        """Whether every rank's routing equals its previous decode step's
        (a cached handle must be used by all ranks or none)."""
        import torch
        import torch.distributed as dist

        same = self._cached is not None and torch.equal(self._cached[0], idx) and torch.equal(self._cached[1], weights)
        flag = torch.tensor([1 if same else 0], dtype=torch.int32, device=idx.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def _dispatch_v2(self, x: Any, idx: Any, weights: Any, decode: bool, dtype: Any) -> tuple[DispatchedTokens, _Handle]:
        import torch

        buf = self._elastic_buffer(idx.shape[1])
        if decode and self._same_routing_everywhere(idx, weights):
            assert self._cached is not None  # the same routing as the cached step's
            _, _, handle, recv_idx, recv_weights = self._cached
            recv_x, _, _, handle, _event = buf.dispatch(x, handle=handle)
        else:
            recv_x, recv_idx, recv_weights, handle, _event = buf.dispatch(
                x, topk_idx=idx, topk_weights=weights, num_experts=self.num_experts, num_max_tokens_per_rank=self.max_tokens,
            )
            self._cached = (idx.clone(), weights.clone(), handle, recv_idx, recv_weights) if decode else None
        n = int(handle.num_recv_tokens)
        counts = torch.tensor(handle.num_recv_tokens_per_expert_list, dtype=torch.int64, device=recv_x.device)
        got = DispatchedTokens("flat", recv_x[:n], counts, recv_idx[:n], recv_weights[:n])
        return got, _Handle("v2", handle, dtype, rows=recv_x.shape[0])

    def combine(self, expert_out: Any, handle: _Handle) -> Any:
        import torch

        y = expert_out.to(torch.bfloat16)
        if handle.kind == "low_latency":
            out, _event, _hook = self._low_latency_buffer().low_latency_combine(y, handle.topk_ids, handle.topk_weights, handle.handle)
        elif handle.kind == "normal":
            out, _weights, _event = self._normal_buffer().combine(y, handle.handle)
        else:
            full = y.new_zeros(handle.rows, y.shape[1])  # the buffer's slack rows carry nothing
            full[: y.shape[0]] = y
            out, _weights, _event = self._elastic.combine(full, handle=handle.handle)
        return out.to(handle.dtype)


def _dequantize_per_128(values: Any, scales: Any) -> Any:
    """Low-latency FP8 dispatch output ([E, M, H] float8, [E, M, H / 128]
    float scales) back to bf16 for the experts."""
    import torch

    e, m, h = values.shape
    x = values.float().reshape(e, m, h // 128, 128) * scales.float().unsqueeze(-1)
    return x.reshape(e, m, h).to(torch.bfloat16)
