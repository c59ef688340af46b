"""Paged attention in Triton: the triton backend's attention backend
(``TritonAttention``).

Pages are ``[Hkv, num_pages, page_size, D]`` per layer (``HEADS_FIRST``,
allocated and copied as the contract's defaults do). A token at position ``n`` of sequence ``b`` lives in
page ``block_tables[b, n // page_size]`` at offset ``n % page_size``: the
kernels compute that per key, so any page size works (7, 16, 48, ...).

* decode (every sequence has exactly one new token): split-K. Grid
  (sequence, KV head, split); each program holds the ``G`` query heads of its
  KV head as the rows of one ``tl.dot`` (grouped-query attention reads each
  K/V page once for the whole group), runs an online softmax over its slice
  of the context and writes a partial (max, sum, accumulator); a second
  kernel merges the splits.
* anything else (prefill chunks, a chunk after a cached prefix, mixed steps,
  sequences with no new token): one ragged causal kernel. Grid (query block,
  KV head); the host turns the step's query lengths into a list of query
  blocks (sequence, first token) once per step in ``build_plan``, so
  no block spans two sequences and no device sync is needed. Keys are read
  back from the pages (the chunk's own K/V are written first), masked
  causally with the sequence's cached prefix offset.

Sliding windows and logit soft caps are masks/transforms inside both kernels.

In deterministic mode (``--deterministic``) every step, decodes included,
runs the ragged kernel with one fixed launch (BLOCK_M from the head group,
BLOCK_N, num_warps and num_stages fixed, no autotuned choice) and key blocks
at absolute multiples of BLOCK_N (a window's first block is rounded down and
masked): a row's online softmax then meets the same block boundaries, in the
same order, whether it is a decode, a verification row or a row of any
chunk, alone or in any batch. The split-K decode is not used there: its
split count follows the batch size.
Under ``TRITON_INTERPRET=1`` (CPU tests) loads are cast to float32 before any
arithmetic (the interpreter computes bf16 on bit patterns); on a GPU the dots
take the storage dtype with float32 accumulation.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
import triton
import triton.language as tl
from plinth.api import HEADS_FIRST, AttentionBackend, AttentionMetadata, AttentionPlan

from plinth_plugin_triton.tuning import tuned


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


def _pow2(n: int, least: int = 1) -> int:
    return max(least, triton.next_power_of_2(max(int(n), 1)))


@triton.jit
def dot(a, b, UPCAST: tl.constexpr):
    """a @ b with float32 accumulation; UPCAST (the interpreter, float32
    models): both sides in float32, full IEEE precision (no TF32)."""
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@tuned("decode", key=["G", "D", "DV", "BLOCK_N"])
@triton.jit
def _decode_split_kernel(
    Q, K, V, BT, SL, MidO, MidM, MidL,
    stride_qt, stride_qh,
    stride_kh, stride_kp, stride_ko,
    stride_vh, stride_vp, stride_vo,
    stride_bt,
    stride_ob, stride_oh, stride_os,
    stride_mb, stride_mh,
    scale, logit_cap, window, page_size, split_len,
    G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_CAP: tl.constexpr, HAS_WINDOW: tl.constexpr, UPCAST: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    h64 = h.to(tl.int64)  # one head's pages may hold over 2^31 elements: 64-bit offsets
    seq_len = tl.load(SL + b)
    start = s * split_len
    end = tl.minimum(start + split_len, seq_len)
    if HAS_WINDOW:
        start = tl.maximum(start, seq_len - window)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    g_mask = offs_g < G
    heads = h * G + offs_g
    q = tl.load(Q + b * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & (offs_d[None, :] < D), other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], -1e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        valid = offs_n < end
        page = tl.load(BT + b * stride_bt + offs_n // page_size, mask=valid, other=0).to(tl.int64)
        off = offs_n % page_size
        k = tl.load(K + h64 * stride_kh + page[:, None] * stride_kp + off[:, None] * stride_ko + offs_d[None, :],
                    mask=valid[:, None] & (offs_d[None, :] < D), other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        else:
            k = k.to(q.dtype)
        scores = dot(q, tl.trans(k), UPCAST) * scale
        if HAS_CAP:
            scores = logit_cap * _tanh(scores / logit_cap)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + h64 * stride_vh + page[:, None] * stride_vp + off[:, None] * stride_vo + offs_dv[None, :],
                    mask=valid[:, None] & (offs_dv[None, :] < DV), other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
            acc = acc * alpha[:, None] + dot(p, v, UPCAST)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    tl.store(MidO + b * stride_ob + heads[:, None] * stride_oh + s * stride_os + offs_dv[None, :], acc,
             mask=g_mask[:, None] & (offs_dv[None, :] < DV))
    tl.store(MidM + b * stride_mb + heads * stride_mh + s, m_i, mask=g_mask)
    tl.store(MidL + b * stride_mb + heads * stride_mh + s, l_i, mask=g_mask)


@triton.jit
def _decode_merge_kernel(
    MidO, MidM, MidL, Out,
    stride_ob, stride_oh, stride_os,
    stride_mb, stride_mh,
    stride_outt, stride_outh,
    num_splits,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, BLOCK_DV)
    s_mask = offs_s < num_splits
    m = tl.load(MidM + b * stride_mb + h * stride_mh + offs_s, mask=s_mask, other=-1e30)
    l_s = tl.load(MidL + b * stride_mb + h * stride_mh + offs_s, mask=s_mask, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(s_mask, tl.exp(m - m_max), 0.0)
    total = tl.sum(l_s * w, 0)
    total = tl.where(total > 0, total, 1.0)
    o = tl.load(MidO + b * stride_ob + h * stride_oh + offs_s[:, None] * stride_os + offs_dv[None, :],
                mask=s_mask[:, None] & (offs_dv[None, :] < DV), other=0.0)
    out = tl.sum(o * w[:, None], 0) / total
    tl.store(Out + b * stride_outt + h * stride_outh + offs_dv, out.to(Out.dtype.element_ty), mask=offs_dv < DV)


@tuned("prefill", key=["G", "BLOCK_M", "D", "DV", "BLOCK_N"])
@triton.jit
def _prefill_kernel(
    Q, K, V, BT, SL, QSL, BlockSeq, BlockStart, Out,
    stride_qt, stride_qh,
    stride_kh, stride_kp, stride_ko,
    stride_vh, stride_vp, stride_vo,
    stride_bt,
    stride_outt, stride_outh,
    scale, logit_cap, window, page_size,
    G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_CAP: tl.constexpr, HAS_WINDOW: tl.constexpr, UPCAST: tl.constexpr, ALIGN_KEYS: tl.constexpr = False,
):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    h64 = h.to(tl.int64)  # one head's pages may hold over 2^31 elements: 64-bit offsets
    seq = tl.load(BlockSeq + pid)
    q_first = tl.load(BlockStart + pid)  # this block's first token (flat batch index)
    seq_q_start = tl.load(QSL + seq)
    seq_q_end = tl.load(QSL + seq + 1)
    seq_len = tl.load(SL + seq)
    prefix = seq_len - (seq_q_end - seq_q_start)

    # rows: BLOCK_M tokens x BLOCK_G heads of this KV head's group
    rows = tl.arange(0, BLOCK_M * BLOCK_G)
    tok = q_first + rows // BLOCK_G
    g = rows % BLOCK_G
    row_valid = (tok < seq_q_end) & (g < G)
    q_pos = prefix + (tok - seq_q_start)
    head = h * G + g
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_valid[:, None] & (offs_d[None, :] < D), other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    last_pos = prefix + (tl.minimum(q_first + BLOCK_M, seq_q_end) - 1 - seq_q_start)
    kv_end = tl.minimum(last_pos + 1, seq_len)
    kv_start = 0
    if HAS_WINDOW:
        first_pos = prefix + (q_first - seq_q_start)
        kv_start = tl.maximum(first_pos - window + 1, 0)
        if ALIGN_KEYS:  # key blocks at absolute multiples of BLOCK_N (deterministic mode)
            kv_start = kv_start // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_M * BLOCK_G], -1e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M * BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_DV], dtype=tl.float32)
    for n0 in range(kv_start, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        in_ctx = offs_n < kv_end
        page = tl.load(BT + seq * stride_bt + offs_n // page_size, mask=in_ctx, other=0).to(tl.int64)
        off = offs_n % page_size
        k = tl.load(K + h64 * stride_kh + page[:, None] * stride_kp + off[:, None] * stride_ko + offs_d[None, :],
                    mask=in_ctx[:, None] & (offs_d[None, :] < D), other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        else:
            k = k.to(q.dtype)
        scores = dot(q, tl.trans(k), UPCAST) * scale
        if HAS_CAP:
            scores = logit_cap * _tanh(scores / logit_cap)
        ok = in_ctx[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            ok = ok & (offs_n[None, :] > q_pos[:, None] - window)
        scores = tl.where(ok, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + h64 * stride_vh + page[:, None] * stride_vp + off[:, None] * stride_vo + offs_dv[None, :],
                    mask=in_ctx[:, None] & (offs_dv[None, :] < DV), other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
            acc = acc * alpha[:, None] + dot(p, v, UPCAST)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    l_i = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_i[:, None]
    tl.store(Out + tok[:, None] * stride_outt + head[:, None] * stride_outh + offs_dv[None, :],
             out.to(Out.dtype.element_ty), mask=row_valid[:, None] & (offs_dv[None, :] < DV))


# ---- host side -------------------------------------------------------------------


@dataclass
class Plan(AttentionPlan):
    """This step's launch plan, from host-side lengths (no device sync)."""

    decode: bool  # every sequence has exactly one new token
    query_lens: list[int]
    device: torch.device
    slots: torch.Tensor
    #: block_m -> (block_seq, block_start) int32 tensors: the query blocks
    blocks: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def query_blocks(self, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(sequence, first token) of every block of ``block_m`` query tokens;
        no block spans two sequences. Made once per step and block size."""
        if block_m not in self.blocks:
            seqs, starts, start = [], [], 0
            for i, n in enumerate(self.query_lens):
                for j in range(0, n, block_m):
                    seqs.append(i)
                    starts.append(start + j)
                start += n
            self.blocks[block_m] = (
                torch.tensor(seqs, dtype=torch.int32).to(self.device, non_blocking=True),
                torch.tensor(starts, dtype=torch.int32).to(self.device, non_blocking=True),
            )
        return self.blocks[block_m]


#: decode: keys per split (a multiple of BLOCK_N); fewer splits when the batch fills the GPU anyway
SPLIT_LEN = 512
BLOCK_N = 64
#: rows (query tokens x group heads) per prefill program
PREFILL_ROWS = 64
#: deterministic mode's one launch configuration of the ragged kernel (no
#: autotuned choice, which could change the dot's reduction order by shape)
DETERMINISTIC_LAUNCH = dict(num_warps=4, num_stages=2)


def decode_splits(num_seqs: int, max_seq_len: int, num_kv_heads: int, target_programs: int = 264) -> tuple[int, int]:
    """(splits, keys per split): split long contexts so that about
    ``target_programs`` programs run, never splits shorter than BLOCK_N."""
    max_seq_len = max(max_seq_len, 1)
    want = max(1, -(-target_programs // max(num_seqs * num_kv_heads, 1)))
    split_len = max(BLOCK_N, -(-max_seq_len // want))
    split_len = min(SPLIT_LEN * 8, -(-split_len // BLOCK_N) * BLOCK_N)
    return -(-max_seq_len // split_len), split_len


def build_plan(meta: AttentionMetadata) -> Plan:
    query_lens = list(meta.query_lens_cpu)
    decode = meta.max_query_len == 1 and sum(query_lens) == len(query_lens)
    return Plan(decode=decode, query_lens=query_lens, device=meta.block_tables.device, slots=meta.slot_mapping.long())


def prefill_block_m(group: int) -> int:
    """Query tokens per prefill program: PREFILL_ROWS rows of tokens x group
    heads, at least 16 rows (tl.dot's minimum)."""
    block_g = _pow2(group)
    return max(PREFILL_ROWS // block_g, -(-16 // block_g), 1)


def _write_pages(pages: torch.Tensor, x: torch.Tensor, slots: torch.Tensor) -> None:
    heads, num_pages, page_size, dim = pages.shape
    pages.view(heads, num_pages * page_size, dim).index_copy_(1, slots, x.transpose(0, 1).to(pages.dtype))


def paged_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    meta: AttentionMetadata,
    plan: Plan,
    *,
    scale: float,
    sliding_window: int | None = None,
    logit_cap: float | None = None,
    deterministic: bool = False,
) -> torch.Tensor:
    """q [T, Hq, D] over pages already holding this step's K/V -> [T, Hq, Dv].
    deterministic: every row through the ragged kernel at one fixed launch."""
    num_tokens, num_heads, dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    dim_v = v_pages.shape[-1]
    group = num_heads // num_kv_heads
    window = int(sliding_window) if sliding_window and sliding_window > 0 else 0
    cap = float(logit_cap) if logit_cap else 0.0
    upcast = interpreting() or q.dtype == torch.float32
    out = q.new_empty(num_tokens, num_heads, dim_v)
    if num_tokens == 0:
        return out
    bt = meta.block_tables
    common = dict(
        G=group, BLOCK_G=_pow2(group), D=dim, BLOCK_D=_pow2(dim, 16), DV=dim_v, BLOCK_DV=_pow2(dim_v, 16),
        BLOCK_N=BLOCK_N, HAS_CAP=cap > 0, HAS_WINDOW=window > 0, UPCAST=upcast,
    )
    if plan.decode and not deterministic:
        b = num_tokens
        num_splits, split_len = decode_splits(b, meta.max_seq_len, num_kv_heads)
        common["BLOCK_G"] = _pow2(group, 16)  # tl.dot needs 16 rows
        mid_o = torch.empty(b, num_heads, num_splits, dim_v, dtype=torch.float32, device=q.device)
        mid_m = torch.empty(b, num_heads, num_splits, dtype=torch.float32, device=q.device)
        mid_l = torch.empty_like(mid_m)
        _decode_split_kernel[(b, num_kv_heads, num_splits)](
            q, k_pages, v_pages, bt, meta.seq_lens, mid_o, mid_m, mid_l,
            q.stride(0), q.stride(1),
            k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
            v_pages.stride(0), v_pages.stride(1), v_pages.stride(2),
            bt.stride(0),
            mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
            mid_m.stride(0), mid_m.stride(1),
            scale, cap, window, page_size, split_len,
            **common,
        )
        _decode_merge_kernel[(b, num_heads)](
            mid_o, mid_m, mid_l, out,
            mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
            mid_m.stride(0), mid_m.stride(1),
            out.stride(0), out.stride(1),
            num_splits,
            DV=dim_v, BLOCK_DV=_pow2(dim_v, 16), BLOCK_S=_pow2(num_splits, 2),
        )
        return out
    block_m = prefill_block_m(group)
    block_seq, block_start = plan.query_blocks(block_m)
    num_blocks = block_seq.numel()
    if num_blocks == 0:
        return out
    common["BLOCK_G"] = _pow2(group)
    kernel, launch = _prefill_kernel, {}
    if deterministic:
        if isinstance(_prefill_kernel, triton.runtime.Autotuner):  # on a GPU: the plain kernel under it
            kernel = _prefill_kernel.fn
        launch = dict(ALIGN_KEYS=True, **({} if interpreting() else DETERMINISTIC_LAUNCH))
    kernel[(num_blocks, num_kv_heads)](
        q, k_pages, v_pages, bt, meta.seq_lens, meta.query_start_loc, block_seq, block_start, out,
        q.stride(0), q.stride(1),
        k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        v_pages.stride(0), v_pages.stride(1), v_pages.stride(2),
        bt.stride(0),
        out.stride(0), out.stride(1),
        scale, cap, window, page_size,
        BLOCK_M=block_m, **common, **launch,
    )
    return out


class TritonAttention(AttentionBackend[Plan]):
    """These kernels over ``HEADS_FIRST`` pages (contiguous D), any page
    size, sliding windows, soft caps, V sharing K's pages; batch-invariant
    in deterministic mode (one launch of the ragged kernel, see above)."""

    layout = HEADS_FIRST
    dtypes = ("float32", "bfloat16", "float16")
    plan_type = Plan

    def build_plan(self, meta: AttentionMetadata) -> Plan:
        return build_plan(meta)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: Any, meta: AttentionMetadata, *, scale: float, sliding_window: int | None = None, logit_cap: float | None = None) -> torch.Tensor:
        plan = self.plan(meta)
        k_pages, v_pages = kv_cache
        _write_pages(k_pages, k, plan.slots)
        if v_pages is None:  # V shares K's pages (MLA-style)
            v_pages = k_pages
        else:
            _write_pages(v_pages, v, plan.slots)
        return paged_attention(
            q, k_pages, v_pages, meta, plan, scale=scale, sliding_window=sliding_window, logit_cap=logit_cap,
            deterministic=self.ctx.deterministic,
        )
