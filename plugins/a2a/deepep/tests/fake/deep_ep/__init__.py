"""A fake ``deep_ep`` for CPU tests of the plugin's glue: the same Python API
as DeepEP 2.x (legacy ``Buffer`` with normal and low-latency kernels,
``Config`` hints, V2 ``ElasticBuffer`` with ``EPHandle``), the same argument
checks (bf16 or fp8 tokens, int64 ids, float32 weights, local received ids
with -1 elsewhere, padded low-latency output, slack rows in V2 output), with
the data moved by ``torch.distributed.all_gather_object`` over the group.
Every call is recorded in ``CALLS`` for the tests."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__version__ = "2.1.0"
CALLS: list[tuple[str, dict]] = []
topk_idx_t = torch.int64


class EventOverlap:
    def __init__(self, event: Any = None) -> None:
        self.event = event

    def current_stream_wait(self) -> None:
        pass


class Config:
    def __init__(self, num_sms: int, *hints: int) -> None:
        self.num_sms, self.hints = num_sms, hints

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return hidden_bytes * num_ranks * 1024

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 0


def _gather(group: Any, obj: Any) -> list[Any]:
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _check_inputs(x: Any, topk_idx: Any, topk_weights: Any = None) -> None:
    assert x.dtype in (torch.bfloat16, torch.float8_e4m3fn), f"x must be bf16 or fp8, got {x.dtype}"
    assert topk_idx.dtype == torch.int64, f"topk_idx must be deep_ep.topk_idx_t (int64), got {topk_idx.dtype}"
    assert topk_weights is None or topk_weights.dtype == torch.float32, "topk_weights must be float32"


class _Flat:
    """Normal-mode movement shared by Buffer and ElasticBuffer."""

    def __init__(self, group: Any, num_experts_hint: int = 0) -> None:
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def _dispatch(self, x: Any, idx: Any, weights: Any, num_experts: int) -> tuple:
        per = num_experts // self.size
        lo, hi = self.rank * per, (self.rank + 1) * per
        rows, ids, ws, src = [], [], [], []
        for s, (xs, i_s, w_s) in enumerate(_gather(self.group, (x, idx, weights))):
            for t in range(xs.shape[0]):
                mine = (i_s[t] >= lo) & (i_s[t] < hi)
                if bool(mine.any()):
                    rows.append(xs[t])
                    ids.append(torch.where(mine, i_s[t] - lo, -1))
                    ws.append(w_s[t] if w_s is not None else torch.zeros(idx.shape[1]))
                    src.append((s, t))
        k = idx.shape[1]
        recv_x = torch.stack(rows) if rows else x.new_zeros(0, x.shape[1])
        recv_idx = torch.stack(ids) if ids else torch.zeros(0, k, dtype=torch.int64)
        recv_w = torch.stack(ws).float() if ws else torch.zeros(0, k)
        counts = [int((recv_idx == e).sum()) for e in range(per)]
        return recv_x, recv_idx, recv_w, counts, src

    def _combine(self, y: Any, src: list, num_tokens: int) -> Any:
        assert y.dtype == torch.bfloat16, "combine takes bf16"
        out = torch.zeros(num_tokens, y.shape[1], dtype=torch.float32)
        for their_src, their_y in _gather(self.group, (src, y[: len(src)])):
            for row, (s, t) in enumerate(their_src):
                if s == self.rank:
                    out[t] += their_y[row].float()
        return out.to(torch.bfloat16)


class Buffer(_Flat):
    num_sms = 20

    def __init__(self, group: Any, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, **kw: Any) -> None:
        super().__init__(group)
        CALLS.append(("Buffer", dict(num_nvl_bytes=num_nvl_bytes, num_rdma_bytes=num_rdma_bytes, low_latency_mode=low_latency_mode, num_qps_per_rank=num_qps_per_rank)))
        self.low_latency_mode = low_latency_mode
        self.num_rdma_bytes = num_rdma_bytes

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        assert num_ranks in (2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160), f"Unsupported number of EP ranks: {num_ranks}"
        return Config(Buffer.num_sms, 24, 256, 6, 128)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return Config(Buffer.num_sms, 10, 256, 6, 128)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int) -> int:
        return num_max_dispatch_tokens_per_rank * hidden * num_experts * 4

    def get_dispatch_layout(self, topk_idx: Any, num_experts: int, previous_event: Any = None, async_finish: bool = False, allocate_on_comm_stream: bool = False) -> tuple:
        assert topk_idx.dtype == torch.int64
        per = num_experts // self.size
        owner = torch.where(topk_idx >= 0, topk_idx // per, -1)
        in_rank = torch.stack([(owner == r).any(1) for r in range(self.size)], 1)
        per_expert = torch.bincount(topk_idx[topk_idx >= 0], minlength=num_experts).int()
        return in_rank.sum(0).int(), None, per_expert, in_rank, EventOverlap()

    def dispatch(self, x: Any, handle: Any = None, num_tokens_per_rank: Any = None, num_tokens_per_rdma_rank: Any = None,
                 is_token_in_rank: Any = None, num_tokens_per_expert: Any = None, topk_idx: Any = None, topk_weights: Any = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Any = None, previous_event: Any = None,
                 async_finish: bool = False, allocate_on_comm_stream: bool = False) -> tuple:
        assert not self.low_latency_mode or self.num_rdma_bytes == 0 or True
        assert handle is None and num_tokens_per_rank is not None and is_token_in_rank is not None and num_tokens_per_expert is not None
        _check_inputs(x, topk_idx, topk_weights)
        CALLS.append(("dispatch", dict(tokens=x.shape[0])))
        num_experts = num_tokens_per_expert.numel()
        recv_x, recv_idx, recv_w, counts, src = self._dispatch(x, topk_idx, topk_weights, num_experts)
        return recv_x, recv_idx, recv_w, counts, (src, x.shape[0]), EventOverlap()

    def combine(self, x: Any, handle: Any, topk_weights: Any = None, bias: Any = None, config: Any = None,
                previous_event: Any = None, async_finish: bool = False, allocate_on_comm_stream: bool = False) -> tuple:
        CALLS.append(("combine", dict(rows=x.shape[0])))
        src, num_tokens = handle
        return self._combine(x, src, num_tokens), None, EventOverlap()

    def low_latency_dispatch(self, x: Any, topk_idx: Any, num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: Any = None, dispatch_wait_recv_cost_stats: Any = None,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False) -> tuple:
        assert self.low_latency_mode, "low-latency kernels need a Buffer built with low_latency_mode=True"
        _check_inputs(x, topk_idx)
        assert x.shape[0] <= num_max_dispatch_tokens_per_rank
        CALLS.append(("low_latency_dispatch", dict(tokens=x.shape[0], num_max=num_max_dispatch_tokens_per_rank, num_experts=num_experts, use_fp8=use_fp8)))
        per = num_experts // self.size
        lo = self.rank * per
        slots = num_max_dispatch_tokens_per_rank * self.size
        recv = torch.zeros(per, slots, x.shape[1], dtype=torch.bfloat16)
        counts = torch.zeros(per, dtype=torch.int32)
        src = [[] for _ in range(per)]
        for s, (xs, i_s) in enumerate(_gather(self.group, (x, topk_idx))):
            for t in range(xs.shape[0]):
                for k in range(i_s.shape[1]):
                    e = int(i_s[t, k]) - lo
                    if 0 <= e < per:
                        recv[e, counts[e]] = xs[t]
                        src[e].append((s, t, int(i_s[t, k])))
                        counts[e] += 1
        handle = (src, None, num_max_dispatch_tokens_per_rank, x.shape[1], num_experts)
        if use_fp8:
            blocks = recv.float().reshape(per, slots, -1, 128)
            scales = blocks.abs().amax(-1).clamp(min=1e-4) / 448.0
            q = (blocks / scales.unsqueeze(-1)).to(torch.float8_e4m3fn).reshape(per, slots, -1)
            return (q, scales), counts, handle, EventOverlap(), None
        return recv, counts, handle, EventOverlap(), None

    def low_latency_combine(self, x: Any, topk_idx: Any, topk_weights: Any, handle: tuple, use_logfmt: bool = False,
                            zero_copy: bool = False, async_finish: bool = False, return_recv_hook: bool = False, out: Any = None) -> tuple:
        assert x.dtype == torch.bfloat16 and topk_weights.dtype == torch.float32 and topk_idx.dtype == torch.int64
        CALLS.append(("low_latency_combine", dict(shape=tuple(x.shape))))
        src = handle[0]
        entries = [(s, t, e_global, x[e, slot]) for e, lst in enumerate(src) for slot, (s, t, e_global) in enumerate(lst)]
        result = torch.zeros(topk_idx.shape[0], x.shape[-1], dtype=torch.float32)
        for their in _gather(self.group, entries):
            for s, t, e_global, row in their:
                if s == self.rank:
                    k = int((topk_idx[t] == e_global).nonzero()[0])
                    result[t] += topk_weights[t, k] * row.float()
        return result.to(torch.bfloat16), EventOverlap(), None


class EPHandle:
    def __init__(self, *, num_experts: int, num_max_tokens_per_rank: int, topk_idx: Any, src: list, num_tokens: int, counts: list[int]) -> None:
        self.do_expand = False
        self.num_experts, self.num_max_tokens_per_rank, self.expert_alignment = num_experts, num_max_tokens_per_rank, 1
        self.topk_idx = topk_idx
        self.num_recv_tokens = len(src)
        self.num_recv_tokens_per_expert_list = counts
        self._src, self._num_tokens = src, num_tokens


class ElasticBuffer(_Flat):
    SLACK = 3  # received tensors are buffer views with rows past num_recv_tokens

    def __init__(self, group: Any, num_bytes: int | None = None, num_cpu_bytes: int = 0, num_max_tokens_per_rank: int = 0,
                 hidden: int = 0, num_topk: int = 0, use_fp8_dispatch: bool = False, **kw: Any) -> None:
        super().__init__(group)
        CALLS.append(("ElasticBuffer", dict(num_max_tokens_per_rank=num_max_tokens_per_rank, hidden=hidden, num_topk=num_topk)))
        self.num_max_tokens_per_rank = num_max_tokens_per_rank

    @staticmethod
    def get_buffer_size_hint(group: Any, num_max_tokens_per_rank: int, hidden: int, num_topk: int = 0, use_fp8_dispatch: bool = False,
                             allow_hybrid_mode: bool = True, allow_multiple_reduction: bool = True) -> int:
        return 2 << 20

    def dispatch(self, x: Any, topk_idx: Any = None, topk_weights: Any = None, cumulative_local_expert_recv_stats: Any = None,
                 num_experts: int | None = None, num_max_tokens_per_rank: int | None = None, expert_alignment: int | None = None,
                 num_sms: int = 0, num_qps: int = 0, previous_event: Any = None, previous_event_before_epilogue: Any = None,
                 async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False, handle: EPHandle | None = None,
                 do_handle_copy: bool = True, do_cpu_sync: bool | None = None, do_expand: bool = False,
                 do_zero_padding: bool = False, use_tma_aligned_col_major_sf: bool = False) -> tuple:
        if handle is not None:
            assert topk_idx is None, "topk_idx must be None with a cached handle"
            topk_idx, num_experts = handle.topk_idx, handle.num_experts
        _check_inputs(x, topk_idx, topk_weights)
        assert num_experts is not None
        assert x.shape[0] <= (num_max_tokens_per_rank or self.num_max_tokens_per_rank)
        CALLS.append(("elastic_dispatch", dict(tokens=x.shape[0], cached=handle is not None)))
        recv_x, recv_idx, recv_w, counts, src = self._dispatch(x, topk_idx, topk_weights, num_experts)
        pad = self.SLACK
        recv_x = torch.cat((recv_x, recv_x.new_zeros(pad, x.shape[1])))
        recv_idx = torch.cat((recv_idx, torch.full((pad, topk_idx.shape[1]), -1)))
        recv_w = torch.cat((recv_w, torch.zeros(pad, topk_idx.shape[1])))
        if handle is not None:
            return recv_x, None, (recv_w if topk_weights is not None else None), handle, EventOverlap()
        new = EPHandle(num_experts=num_experts, num_max_tokens_per_rank=num_max_tokens_per_rank or self.num_max_tokens_per_rank,
                       topk_idx=topk_idx.clone(), src=src, num_tokens=x.shape[0], counts=counts)
        return recv_x, recv_idx, (recv_w if topk_weights is not None else None), new, EventOverlap()

    def combine(self, x: Any, handle: EPHandle, topk_weights: Any = None, bias: Any = None, num_sms: int = 0, num_qps: int = 0,
                previous_event: Any = None, previous_event_before_epilogue: Any = None, async_with_compute_stream: bool = False,
                allocate_on_comm_stream: bool = False) -> tuple:
        assert x.shape[0] >= handle.num_recv_tokens
        CALLS.append(("elastic_combine", dict(rows=x.shape[0])))
        return self._combine(x, handle._src, handle._num_tokens), None, EventOverlap()
