"""MoE dispatch and combine with ``torch.distributed.all_to_all_single``.

Dispatch, two collectives: the per-rank row counts, then one payload. A token
goes once to each rank owning at least one of its top-k experts (not once per
expert), as DeepEP's normal mode does; its row carries the hidden state and,
packed behind it, its top-k ids (local to the receiving rank, -1 for experts
elsewhere) and weights. Everything travels as bytes (a uint8 view), so any
dtype moves, float8 included (gloo rejects float8 tensors), and split sizes
may be uneven or zero. Combine, one collective: each rank's weighted expert
sums go back to the senders, which add the partial sums of their tokens.

Layouts: "flat" for prefill and mixed steps; for decode-only steps, "padded"
([local experts, max tokens per expert, hidden], as DeepEP's low-latency
mode hands its experts), built locally from the flat rows; combine then
applies the weights. ``decode_layout="flat"`` keeps the flat layout always.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from plinth.api import AllToAll, DispatchedTokens, SelectionContext, expert_ranges


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A [rows, bytes] uint8 view of a 2-D tensor (contiguous)."""
    t = t.contiguous()
    return t.view(torch.uint8).reshape(t.shape[0], t.shape[1] * t.element_size())


@dataclass
class _Handle:
    send_tokens: torch.Tensor  # [P] token index of each sent row, grouped by destination rank
    send_splits: list[int]
    recv_splits: list[int]
    num_tokens: int
    # padded layout only: each (received row, k) pair's expert, slot and weight
    rows: torch.Tensor | None = None
    experts: torch.Tensor | None = None
    slots: torch.Tensor | None = None
    weights: torch.Tensor | None = None


class CollectiveAllToAll(AllToAll):
    """torch.distributed all_to_all_single over ``group`` (the ep group)."""

    @classmethod
    def check(cls, ctx: SelectionContext) -> list[str]:
        if importlib.util.find_spec("torch") is None:
            return ["torch is not installed"]
        import torch.distributed

        if not torch.distributed.is_available():
            return ["this torch build has no torch.distributed"]
        return []

    def __init__(self, ctx: SelectionContext, *, group: Any, num_experts: int, hidden_size: int, decode_layout: str | None = None) -> None:
        super().__init__(ctx, group=group, num_experts=num_experts, hidden_size=hidden_size)
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        ranges = expert_ranges(num_experts, self.size)  # uneven: the first E % size ranks own one more
        self.per_rank = len(ranges[self.rank])  # this rank's experts
        #: the first global expert of each rank, and E after the last
        self.starts = torch.tensor([r.start for r in ranges] + [num_experts])
        self.decode_layout = decode_layout or str(ctx.options.get("nccl_decode_layout", "padded"))
        if self.decode_layout not in ("padded", "flat"):
            raise ValueError(f"nccl a2a: decode layout must be padded or flat, not {self.decode_layout!r}")

    def _exchange(self, rows: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        out = torch.empty(sum(recv), rows.shape[1], dtype=rows.dtype, device=rows.device)
        dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=self.group)
        return out

    def dispatch(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *, decode: bool) -> tuple[DispatchedTokens, _Handle]:
        num_tokens, top_k = topk_ids.shape
        dev, per = hidden.device, self.per_rank
        ids = topk_ids.long()
        starts = self.starts.to(dev)
        dest = torch.searchsorted(starts[1:-1], ids, right=True)  # [T, K] owning rank of each choice
        in_rank = torch.zeros(num_tokens, self.size, dtype=torch.bool, device=dev)
        in_rank.scatter_(1, dest, True)
        send_counts = in_rank.sum(0)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        # (rank, token) pairs grouped by rank, found on the device: a stable sort
        # puts the chosen pairs first (no nonzero(), whose size needs the host)
        order = torch.argsort((~in_rank.t()).reshape(-1).to(torch.int8), stable=True)
        splits = torch.cat((send_counts, recv_counts)).tolist()  # the one host sync: all_to_all_single takes host splits
        send, recv = splits[: self.size], splits[self.size :]
        pairs = order[: sum(send)]
        to_rank, send_tokens = pairs // num_tokens, pairs % num_tokens

        local = ids.index_select(0, send_tokens) - starts[to_rank].unsqueeze(1)
        here = (local >= 0) & (local < (starts[to_rank + 1] - starts[to_rank]).unsqueeze(1))
        meta = torch.cat(
            (torch.where(here, local, -1).to(torch.float32), torch.where(here, topk_weights.index_select(0, send_tokens).float(), 0.0)), 1
        )
        x_bytes = _bytes(hidden.index_select(0, send_tokens))
        payload = torch.cat((x_bytes, _bytes(meta)), 1)
        got = self._exchange(payload, send, recv)

        xb = x_bytes.shape[1]
        x = got[:, :xb].contiguous().view(hidden.dtype).reshape(got.shape[0], hidden.shape[1])
        meta = got[:, xb:].contiguous().view(torch.float32).reshape(got.shape[0], 2 * top_k)
        recv_ids, recv_weights = meta[:, :top_k].long(), meta[:, top_k:]
        valid = recv_ids >= 0
        # per-expert counts on the device (bincount sizes its output from a host-read max)
        counts = torch.zeros(per + 1, dtype=torch.int64, device=dev)
        counts.scatter_add_(0, torch.where(valid, recv_ids, per).reshape(-1), torch.ones_like(recv_ids).reshape(-1))
        counts = counts[:per]
        handle = _Handle(send_tokens, send, recv, num_tokens)
        if not (decode and self.decode_layout == "padded"):
            return DispatchedTokens("flat", x, counts, recv_ids, recv_weights), handle

        # padded: each (row, k) pair in its expert's slab, in arrival order, as DeepEP's
        # low-latency layout: [local experts, rows received, hidden] (an expert gets a row
        # at most once); pairs for experts elsewhere land in a spare slab that is dropped
        rows_in = got.shape[0]
        experts = torch.where(valid, recv_ids, per).reshape(-1)
        order = torch.argsort(experts, stable=True)
        experts = experts[order]
        rows, ks = order // top_k, order % top_k
        full = torch.cat((counts, (~valid).sum().reshape(1)))
        starts = torch.cumsum(full, 0) - full
        slots = torch.arange(experts.shape[0], device=dev) - starts[experts]
        padded = torch.zeros(per + 1, max(rows_in, 1), x.shape[1], dtype=x.dtype, device=dev)
        padded[experts, slots.clamp(max=max(rows_in, 1) - 1)] = x[rows]
        weights = torch.where(experts < per, recv_weights[rows, ks], 0.0)
        handle.rows, handle.experts, handle.slots, handle.weights = rows, experts.clamp(max=per - 1), slots.clamp(max=max(rows_in, 1) - 1), weights
        return DispatchedTokens("padded", padded[:per], counts), handle

    def combine(self, expert_out: torch.Tensor, handle: _Handle) -> torch.Tensor:
        """-> [T, H] in expert_out's dtype: every sender's tokens, summed over
        the ranks that computed part of them."""
        if handle.rows is not None:  # padded: weight each (row, expert) output into its row
            hidden = expert_out.shape[-1]
            flat = torch.zeros(sum(handle.recv_splits), hidden, dtype=torch.float32, device=expert_out.device)
            picked = expert_out[handle.experts, handle.slots].float() * handle.weights.unsqueeze(1)
            flat.index_add_(0, handle.rows, picked)
            expert_out = flat.to(expert_out.dtype)
        hidden = expert_out.shape[-1]
        back = self._exchange(_bytes(expert_out), handle.recv_splits, handle.send_splits)
        back = back.view(expert_out.dtype).reshape(back.shape[0], hidden)
        out = torch.zeros(handle.num_tokens, hidden, dtype=torch.float32, device=expert_out.device)
        out.index_add_(0, handle.send_tokens, back.float())
        return out.to(expert_out.dtype)
