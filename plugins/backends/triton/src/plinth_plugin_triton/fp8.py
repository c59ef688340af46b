"""FP8 linear layers: block-scaled W8A8 and weight-only FP8.

Checkpoints quantized as DeepSeek-V3 and Qwen3-FP8 are (``quant_method:
fp8``, ``weight_block_size: [128, 128]``) store each weight as float8_e4m3
[N, K] with one float32 scale per 128x128 block (``weight_scale_inv``: the
multiplier back to real values). Per-tensor FP8 checkpoints have one scale.

* W8A8 (``w8a8_block_gemm``, compute capability 9.0 and up, where FP8 tensor
  cores are native): activations are quantized per token and per group of
  128 input features (``act_quant``: one float32 scale per [1, 128] group, the
  group's absolute max over 448), then each 128-wide K step multiplies FP8
  tiles on the tensor cores and applies the activation scale (per row) and
  the weight block's scale (per column) to the step's float32 partial sum.
* weight-only (``weight_only_gemm``, below 9.0 and for per-tensor or
  per-channel scales): the FP8 weight tile is loaded, dequantized in
  registers (value * its block's scale) and multiplied in the activation
  dtype; memory traffic stays at one byte per weight.

``pack`` turns a ``QuantizedWeight`` into ``FP8Linear`` (scales normalized to
a 2-D block grid: per tensor is one block of the whole weight, per channel a
[N, 1] grid of [1, K] blocks); ``linear`` takes either path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from plinth_plugin_triton.attention import dot, interpreting

FP8_MAX = 448.0  # float8_e4m3fn
GROUP = 128


@triton.jit
def _act_quant_kernel(X, Q, S, stride_x, stride_q, stride_s, n_cols, GROUP_SIZE: tl.constexpr):
    row = tl.program_id(0)
    grp = tl.program_id(1)
    cols = grp * GROUP_SIZE + tl.arange(0, GROUP_SIZE)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), 0), 1e-10)
    scale = amax / 448.0
    q = tl.clamp(x / scale, -448.0, 448.0)
    tl.store(Q + row * stride_q + cols, q.to(Q.dtype.element_ty), mask=mask)
    tl.store(S + row * stride_s + grp, scale)


def act_quant(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn [M, K], float32 scales [M, ceil(K / group)])."""
    m, k = x.shape
    groups = triton.cdiv(k, group)
    # the interpreter's float32 -> float8 cast is wrong where rounding carries
    # into the next binade (-126.07 -> -64, not -128): there the kernel writes
    # the scaled values in float32 and torch casts them (round to nearest)
    staged = interpreting()
    q = torch.empty(m, k, dtype=torch.float32 if staged else torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if m:
        _act_quant_kernel[(m, groups)](x, q, s, x.stride(0), q.stride(0), s.stride(0), k, GROUP_SIZE=group)
    return (q.to(torch.float8_e4m3fn) if staged else q), s


@triton.jit
def _w8a8_block_kernel(
    A, AS, B, BS, C, BIAS,
    M, N, K,
    stride_am, stride_asm, stride_bn, stride_bsn, stride_bsk, stride_cm,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # BLOCK_K == the quantization group (128): one activation scale and one
    # weight-block scale per K step; BLOCK_N divides 128
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(A + offs_m[:, None] * stride_am + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(B + offs_n[None, :] * stride_bn + offs_k[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        a_s = tl.load(AS + offs_m * stride_asm + kb, mask=m_ok, other=0.0)
        b_s = tl.load(BS + (offs_n // 128) * stride_bsn + kb * stride_bsk, mask=n_ok, other=0.0)
        part = dot(a, b, UPCAST)  # FP8 x FP8 on the tensor cores
        acc += part * a_s[:, None] * b_s[None, :]
    if HAS_BIAS:
        acc += tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(C + offs_m[:, None] * stride_cm + offs_n[None, :], acc.to(C.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _weight_only_kernel(
    A, B, BS, C, BIAS,
    M, N, K, block_n, block_k,
    stride_am, stride_bn, stride_bsn, stride_bsk, stride_cm,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, FP8_BITS: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(A + offs_m[:, None] * stride_am + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(B + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        s = tl.load(BS + (offs_n[None, :] // block_n) * stride_bsn + (offs_k[:, None] // block_k) * stride_bsk,
                    mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        if FP8_BITS:  # e4m3fn bytes (uint8): decoded here, no float8 pointer (Triton rejects them below sm_89)
            bits = b.to(tl.int32)
            e = (bits >> 3) & 15
            m = bits & 7
            # normal: (8 + m) * 2^(e - 10) = (1 + m/8) * 2^(e - 7); subnormal (e = 0): m * 2^-9
            mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, (m + 8).to(tl.float32) * tl.exp2((e - 10).to(tl.float32)))
            b32 = tl.where((bits & 128) != 0, -mag, mag)
        else:
            b32 = b.to(tl.float32)
        w = b32 * s  # dequantized in registers
        acc += dot(a, w.to(a.dtype), UPCAST)
    if HAS_BIAS:
        acc += tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(C + offs_m[:, None] * stride_cm + offs_n[None, :], acc.to(C.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@dataclass
class FP8Linear:
    """A packed FP8 weight: qweight [N, K] float8_e4m3fn, scale [ceil(N/bn),
    ceil(K/bk)] float32 over blocks (bn, bk); mode "w8a8", "weight_only" or
    "weight_only_bits" (qweight then holds the e4m3fn bytes as uint8)."""

    qweight: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]
    mode: str
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() * self.qweight.element_size() + self.scale.numel() * 4


def normalized_scale(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int] | None) -> tuple[torch.Tensor, tuple[int, int]]:
    """Any scale layout as (a 2-D block grid of float32 scales, block size)."""
    n, k = shape
    s = scale.to(torch.float32)
    if block is not None:
        bn, bk = block
        return s.reshape(triton.cdiv(n, bn), triton.cdiv(k, bk)).contiguous(), (bn, bk)
    if s.numel() == 1:
        return s.reshape(1, 1).contiguous(), (n, k)
    if s.numel() == n:
        return s.reshape(n, 1).contiguous(), (1, k)
    raise ValueError(f"triton fp8: cannot read a scale of shape {tuple(scale.shape)} for a weight of shape {shape}")


def pack(weight, path: str) -> FP8Linear:
    """A ``QuantizedWeight`` of format fp8_e4m3 -> FP8Linear for the FP8
    ``path`` the backend chose: W8A8 only for 128x128 blocks on a GPU with
    native FP8; "weight_only_bits" keeps the bytes as uint8 (decoded in the
    kernel), "weight_only" as float8_e4m3fn."""
    n, k = weight.shape
    q = weight.qweight.reshape(n, k)
    if q.dtype != torch.float8_e4m3fn:
        q = q.view(torch.float8_e4m3fn) if q.dtype == torch.uint8 else q.to(torch.float8_e4m3fn)
    scale, block = normalized_scale(weight.scale, (n, k), tuple(weight.block_size) if weight.block_size else None)
    if path == "weight_only_bits":
        return FP8Linear(qweight=q.contiguous().view(torch.uint8), scale=scale, block=block, mode=path, shape=(n, k))
    mode = "w8a8" if path == "w8a8" and block == (GROUP, GROUP) else "weight_only"
    return FP8Linear(qweight=q.contiguous(), scale=scale, block=block, mode=mode, shape=(n, k))


def _blocks(m: int) -> tuple[int, int]:
    if interpreting():
        return 16, 64
    return (16 if m <= 16 else 64), 128


def linear(x: torch.Tensor, w: FP8Linear, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequant(w).T (+ bias) -> [..., N] in x's dtype."""
    n, k = w.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*lead, n)
    block_m, block_n = _blocks(m)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    upcast = interpreting()
    if w.mode == "w8a8":
        aq, a_s = act_quant(x2)
        _w8a8_block_kernel[grid](
            aq, a_s, w.qweight, w.scale, out, bias if bias is not None else out,
            m, n, k,
            aq.stride(0), a_s.stride(0), w.qweight.stride(0), w.scale.stride(0), w.scale.stride(1), out.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=GROUP, UPCAST=upcast,
        )
    else:
        _weight_only_kernel[grid](
            x2, w.qweight, w.scale, out, bias if bias is not None else out,
            m, n, k, w.block[0], w.block[1],
            x2.stride(0), w.qweight.stride(0), w.scale.stride(0), w.scale.stride(1), out.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64, UPCAST=upcast or x.dtype == torch.float32,
            FP8_BITS=w.mode == "weight_only_bits",
        )
    return out.view(*lead, n)


def quantize_block(w: torch.Tensor, block: tuple[int, int] = (GROUP, GROUP)) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense [N, K] weight -> (float8_e4m3fn [N, K], float32 scale_inv
    [ceil(N/bn), ceil(K/bk)]) as DeepSeek-V3 / Qwen3-FP8 checkpoints store
    it (value = q * scale_inv). For tests and the GPU benchmark."""
    n, k = w.shape
    bn, bk = block
    pn, pk = triton.cdiv(n, bn) * bn, triton.cdiv(k, bk) * bk
    wp = torch.zeros(pn, pk, dtype=torch.float32, device=w.device)
    wp[:n, :k] = w.float()
    blocks = wp.view(pn // bn, bn, pk // bk, bk)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-10)
    scale = amax / FP8_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(pn, pk)[:n, :k].contiguous(), scale
