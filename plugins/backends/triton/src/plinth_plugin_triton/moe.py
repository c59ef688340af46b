"""Fused MoE experts as two grouped GEMMs over tokens sorted and aligned by expert.

``align`` (torch ops on the device, no host sync) sorts the (token, k) pairs
by expert and pads each expert's group to a multiple of ``BLOCK_M`` rows;
every block of ``BLOCK_M`` rows then belongs to one expert (or to none: the
blocks past the end, skipped at once). The row count is bounded on the host
without reading the routing, ``T*K + min(E, T*K) * (BLOCK_M - 1)``, so a
launch never waits for the device (and would fit a CUDA graph).

* GEMM 1 (``_moe_gate_up_kernel``): each block gathers its tokens' rows of x
  and multiplies them by its expert's gate rows and up rows at once (two
  accumulators), writing silu(gate) * up: the activation is fused.
* GEMM 2 (``_moe_down_kernel``): the activation rows times the expert's down
  projection, scaled by each pair's routing weight, stored at the pair's own
  row of a [T*K, H] float32 buffer (no atomics: deterministic); the K rows of
  a token are then summed. Pairs routed nowhere (ids outside [0, E): other
  ranks' experts, padding) keep their zero row.

Experts with no tokens get no block. Under ``TRITON_INTERPRET=1`` loads are
cast to float32 before the dots (see attention.py), and the activations
stay float32 (the interpreter's float32 -> bfloat16 cast truncates).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plinth_plugin_triton.attention import dot, interpreting
from plinth_plugin_triton.tuning import tuned


@tuned("moe", key=["hidden", "inter", "BLOCK_M"])
@triton.jit
def _moe_gate_up_kernel(
    X, W13, SortedPairs, BlockExpert, Act,
    num_pairs, top_k, inter, hidden,
    stride_xt, stride_we, stride_wn, stride_wk, stride_at,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(BlockExpert + pid_m).to(tl.int64)
    if e < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(SortedPairs + offs_m)
    row_ok = pair < num_pairs
    tok = (pair // top_k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < hidden
        a = tl.load(X + tok[:, None] * stride_xt + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_base = W13 + e * stride_we + offs_k[:, None] * stride_wk
        wg = tl.load(w_base + offs_n[None, :] * stride_wn, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        wu = tl.load(w_base + (offs_n[None, :] + inter) * stride_wn, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc_g += dot(a, wg, UPCAST)
        acc_u += dot(a, wu, UPCAST)
    # the reference rounds each GEMM to the activation dtype before silu * up
    g = acc_g.to(Act.dtype.element_ty).to(tl.float32)
    u = acc_u.to(Act.dtype.element_ty).to(tl.float32)
    act = g * tl.sigmoid(g) * u
    tl.store(Act + offs_m[:, None] * stride_at + offs_n[None, :], act.to(Act.dtype.element_ty), mask=n_ok[None, :])


@tuned("moe", key=["hidden", "inter", "BLOCK_M"])
@triton.jit
def _moe_down_kernel(
    Act, W2, SortedPairs, BlockExpert, TopkW, Out,
    num_pairs, hidden, inter,
    stride_at, stride_we, stride_wn, stride_wk, stride_ot,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(BlockExpert + pid_m).to(tl.int64)
    if e < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(SortedPairs + offs_m)
    row_ok = pair < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < inter
        a = tl.load(Act + offs_m[:, None] * stride_at + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(W2 + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc += dot(a, w, UPCAST)
    weight = tl.load(TopkW + pair, mask=row_ok, other=0.0).to(tl.float32)
    # each expert's output in the activation dtype (as the reference's linear), then weighted in float32
    y = acc.to(Act.dtype.element_ty).to(tl.float32) * weight[:, None]
    tl.store(Out + pair.to(tl.int64)[:, None] * stride_ot + offs_n[None, :], y, mask=row_ok[:, None] & n_ok[None, :])


def block_config(num_pairs: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): small M blocks for decode-sized batches
    (little padding per expert), 64-row blocks for prefill."""
    if interpreting():
        return 16, 64, 64
    return (16 if num_pairs <= 512 else 64), 64, 64


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs [R], block_expert [R // block_m]): pair indices (t * K + k)
    grouped by expert, each group padded with the sentinel T*K to a multiple
    of block_m; each block's expert, -1 past the last group. Device ops only."""
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    max_rows = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    max_rows = -(-max_rows // block_m) * block_m
    valid = (flat >= 0) & (flat < num_experts)
    bucket = torch.where(valid, flat, num_experts)
    order = torch.argsort(bucket, stable=True)
    # per-expert counts on the device: bincount sizes its output from the input's max, a host sync
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts = counts.scatter_add_(0, bucket, torch.ones_like(bucket))[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    cnt_start = torch.cumsum(counts, 0) - counts
    sorted_bucket = bucket.index_select(0, order)
    e = sorted_bucket.clamp(max=num_experts - 1)
    rank = torch.arange(num_pairs, device=device) - cnt_start.index_select(0, e)
    dest = pad_start.index_select(0, e) + rank
    dest = torch.where(sorted_bucket < num_experts, dest, max_rows)  # unrouted pairs: the dump row
    sorted_pairs = torch.full((max_rows + 1,), num_pairs, dtype=torch.int64, device=device)
    sorted_pairs.index_copy_(0, dest, order)  # dump-row writes collide harmlessly
    sorted_pairs = sorted_pairs[:max_rows]
    block_first = torch.arange(0, max_rows, block_m, device=device)
    block_expert = torch.searchsorted(pad_end, block_first, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_pairs, block_expert


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """``FusedMoEOp``: y[t] = sum_k w[t, k] * down_e(silu(gate_e(x[t])) * up_e(x[t]))."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1] if topk_ids.dim() == 2 else 1
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return x.new_zeros(num_tokens, w2.shape[1])
    x = x if x.stride(-1) == 1 else x.contiguous()
    block_m, block_n, block_k = block_config(num_pairs)
    sorted_pairs, block_expert = align(topk_ids, num_experts, block_m)
    rows = sorted_pairs.numel()
    upcast = interpreting() or x.dtype == torch.float32
    # the interpreter's float32 -> bfloat16 cast truncates (no round-to-nearest):
    # there the activations stay float32, rounded once at the end in torch
    act_dtype = torch.float32 if upcast and interpreting() else x.dtype
    act = torch.empty(rows, inter, dtype=act_dtype, device=x.device)
    _moe_gate_up_kernel[(rows // block_m, triton.cdiv(inter, block_n))](
        x, w13, sorted_pairs, block_expert, act,
        num_pairs, top_k, inter, hidden,
        x.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), act.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=upcast,
    )
    out_pairs = torch.zeros(num_pairs, w2.shape[1], dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1)
    weights = weights if weights.is_contiguous() else weights.contiguous()
    _moe_down_kernel[(rows // block_m, triton.cdiv(w2.shape[1], block_n))](
        act, w2, sorted_pairs, block_expert, weights, out_pairs,
        num_pairs, w2.shape[1], inter,
        act.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), out_pairs.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=upcast,
    )
    return out_pairs.view(num_tokens, top_k, -1).sum(1).to(x.dtype)
