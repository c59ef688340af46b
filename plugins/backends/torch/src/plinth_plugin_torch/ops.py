"""The dense ops of the reference backend: norms, linear (plain and weight-only
quantized), activation, rotary embedding, page copies and MoE experts.

Every op follows the signatures documented with ``OP_NAMES`` in
``plinth.contract.backend`` and runs on any torch device.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from plinth.api import QuantizedWeight

# ---- rms_norm ------------------------------------------------------------------


#: inputs up to this many elements (decode-sized) take the layer_norm route on CPU
_SMALL_NORM = 1 << 16
_DOUBLED_ATTR = "_plinth_rms_weight_doubled"


def _rms_norm_small_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm as one fused layer_norm kernel: over [x, -x] the mean is 0
    and the variance is mean(x^2), so layer_norm's first half is x / rms(x).
    On CPU, F.rms_norm runs as ~10 separate kernels, and for the few rows of
    a decode step their dispatch costs more than the arithmetic."""
    d = x.shape[-1]
    doubled = vars(weight).get(_DOUBLED_ATTR)
    if doubled is None:
        doubled = torch.cat((weight, torch.zeros_like(weight)))
        vars(weight)[_DOUBLED_ATTR] = doubled
    y = F.layer_norm(torch.cat((x, x.neg()), -1), (2 * d,), doubled, None, eps)[..., :d]
    return y.contiguous()


def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, limit: int = _SMALL_NORM) -> torch.Tensor:
    if weight is not None and x.numel() <= limit and x.device.type == "cpu" and weight.dtype == x.dtype:
        return _rms_norm_small_cpu(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None = None):
    """y = x / rms(x) * weight; with ``residual``, first x = x + residual and
    return (y, x) so the caller keeps the summed stream for the next block."""
    if residual is not None:
        x = x + residual
        return _rms_norm(x, weight, eps), x
    return _rms_norm(x, weight, eps)


def rms_norm_rowwise(x: torch.Tensor, weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None = None):
    """rms_norm for deterministic mode: on CPU one route for every batch
    size (layer_norm's kernel reduces each row on its own), where the
    default switches route by the batch's size."""
    if residual is not None:
        x = x + residual
        return _rms_norm(x, weight, eps, limit=1 << 62), x
    return _rms_norm(x, weight, eps, limit=1 << 62)


# ---- linear --------------------------------------------------------------------


def pack_linear(weight: torch.Tensor | QuantizedWeight) -> torch.Tensor | QuantizedWeight:
    """The reference keeps weights as they are (the cpukernels backend, for one,
    repacks them into a blocked layout)."""
    return weight


def linear(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias); a ``QuantizedWeight`` is dequantized to x's dtype."""
    if isinstance(weight, QuantizedWeight):
        weight = dequantize_weight(weight, x.dtype)
    return F.linear(x, weight, bias)


def linear_rowwise(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """linear for deterministic mode: each row as its own one-row GEMM, from
    a buffer of the same shape and alignment, so every row runs the same
    call whatever its batch (F.linear's kernels pick their blocking, and so
    each output's summation order, by the number of rows). Slow: one call a
    row (SmolLM2-135M's step of linears in bf16, bench/batch_invariant.py
    --backend torch, one thread, loaded AMD EPYC Zen 4: 1.15x F.linear's
    time at 1 row, 7.4x at 16, 11x at 64); it serves what a backend cannot
    run batch-invariantly."""
    if isinstance(weight, QuantizedWeight):
        weight = dequantize_weight(weight, x.dtype)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    out = torch.empty(x2.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    row = torch.empty(1, shape[-1], dtype=x.dtype, device=x.device)
    for i in range(x2.shape[0]):
        row.copy_(x2[i : i + 1])
        out[i : i + 1] = F.linear(row, weight, bias)
    return out.view(*shape[:-1], weight.shape[0])


def _expand_scale(scale: torch.Tensor, shape: tuple[int, int], block_size: tuple[int, int] | None) -> torch.Tensor:
    """The scale broadcast to the weight's [out, in] shape, in float32."""
    n, k = shape
    s = scale.to(torch.float32)
    if s.numel() == 1:
        return s.reshape(1, 1)
    if block_size is not None:
        bn, bk = block_size
        s = s.reshape((n + bn - 1) // bn, (k + bk - 1) // bk)
        return s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    if s.numel() == n:  # per output channel
        return s.reshape(n, 1)
    if s.dim() == 2 and s.shape[0] == n and k % s.shape[1] == 0:  # per group along the input
        return s.repeat_interleave(k // s.shape[1], 1)
    raise ValueError(f"cannot broadcast a scale of shape {tuple(scale.shape)} to a weight of shape {shape}")


#: the QuantizedWeight formats this backend can dequantize (weight-only)
QUANT_FORMATS = ("fp8_e4m3", "fp8_e5m2", "int8")


def dequantize_weight(weight: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """The dense [out, in] weight in ``dtype``: qweight * scale (per tensor,
    per output channel, per input group, or per [bn, bk] block)."""
    if weight.format not in QUANT_FORMATS:
        raise ValueError(f"torch backend: unsupported quantized weight format {weight.format!r} (supports {QUANT_FORMATS})")
    n, k = weight.shape
    q = weight.qweight.reshape(n, k).to(torch.float32)
    return (q * _expand_scale(weight.scale, (n, k), weight.block_size)).to(dtype)


# ---- activation -------------------------------------------------------------------


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:] for the fused gate/up projection."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


# ---- rotary -----------------------------------------------------------------------


def _version(t: torch.Tensor) -> int | None:
    """The in-place modification counter; None for inference-mode tensors,
    which do not keep one."""
    return None if t.is_inference() else t._version


_TABLES_ATTR = "_plinth_rotary_tables"


def _full_tables(cos_sin: torch.Tensor, dtype: torch.dtype, is_neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[max_pos, rotary_dim] cos and signed-sin tables laid out for one
    multiply-add per rotated feature, made once per table and kept on it."""
    tables = vars(cos_sin).setdefault(_TABLES_ATTR, {})
    key = (dtype, is_neox)
    if key not in tables:
        half = cos_sin.shape[-1] // 2
        cos, sin = cos_sin[:, :half], cos_sin[:, half:]
        if is_neox:
            cos_full, sin_signed = torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)
        else:
            cos_full, sin_signed = cos.repeat_interleave(2, -1), torch.stack((-sin, sin), -1).flatten(-2)
        # cast before multiplying, as transformers does
        tables[key] = (cos_full.to(dtype).contiguous(), sin_signed.to(dtype).contiguous())
    return tables[key]


class _RotaryMemo:
    """The last cos/sin rows gathered: every layer rotates with the same
    ``positions`` tensor, so the rows are gathered once per step. Keyed by
    identity plus, so that a positions buffer refilled in place is noticed,
    the tensor's version or (inference-mode tensors keep no version) the
    step count that the attention backend's build_plan advances."""

    __slots__ = ("positions", "version", "step", "table", "dtype", "is_neox", "cos", "sin")

    def __init__(self) -> None:
        self.positions: Any = None
        self.version: Any = None
        self.table: Any = None
        self.dtype: Any = None
        self.is_neox: Any = None
        self.cos: Any = None
        self.sin: Any = None
        self.step = -1


_rotary_memo = _RotaryMemo()
_step = 0  # advanced by the attention backend's build_plan, once per forward step


def new_step() -> None:
    """Called once per step (by the attention backend's build_plan): per-step memos expire."""
    global _step
    _step += 1


def _rotary_factors(positions: torch.Tensor, cos_sin: torch.Tensor, dtype: torch.dtype, is_neox: bool):
    m = _rotary_memo
    version = _version(positions)
    if (
        m.positions is positions
        and m.table is cos_sin
        and m.dtype == dtype
        and m.is_neox == is_neox
        and (m.version == version if version is not None else (m.step == _step and _step > 0))
    ):
        return m.cos, m.sin
    cos_full, sin_signed = _full_tables(cos_sin, dtype, is_neox)
    index = positions.reshape(-1)
    cos = cos_full.index_select(0, index).unsqueeze(1)  # [T, 1, rotary_dim]
    sin = sin_signed.index_select(0, index).unsqueeze(1)
    m.positions, m.version, m.step, m.table, m.dtype, m.is_neox, m.cos, m.sin = (
        positions, version, _step, cos_sin, dtype, is_neox, cos, sin
    )
    return cos, sin


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    flat = x.dim() == 2
    rd = cos.shape[-1]
    if flat:  # [T, H * D] with D == rotary_dim
        x = x.view(x.shape[0], -1, rd)
    xr = x[..., :rd]
    if is_neox:
        half = rd // 2
        swapped = torch.cat((xr[..., half:], xr[..., :half]), -1)
    else:
        swapped = torch.stack((xr[..., 1::2], xr[..., 0::2]), -1).flatten(-2)
    out = torch.addcmul(xr * cos, swapped, sin)
    if rd < x.shape[-1]:
        out = torch.cat((out, x[..., rd:]), -1)
    return out.flatten(1) if flat else out


def _adjacent_heads(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """q and k as one [T, Hq + Hkv, D] view when k's heads follow q's in
    memory (as when both are views of one fused qkv projection), so one
    rotation covers both; None otherwise."""
    if q.dim() != 3 or k.dim() != 3 or q.dtype != k.dtype or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        return None
    d = q.shape[2]
    if q.stride()[1:] != (d, 1) or k.stride() != q.stride():
        return None
    if k.data_ptr() != q.data_ptr() + q.shape[1] * d * q.element_size():
        return None
    if q.untyped_storage().data_ptr() != k.untyped_storage().data_ptr():
        return None
    return q.as_strided((q.shape[0], q.shape[1] + k.shape[1], d), q.stride())


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, is_neox: bool):
    """Rotary position embedding of q [T, Hq, D] and k [T, Hkv, D] (or flat
    [T, H * D] when D is the rotary dim). cos_sin: [max_pos, rotary_dim], the
    cos half then the sin half; the first rotary_dim features of each head
    rotate, in halves (neox) or in even/odd pairs (GPT-J). Returns new
    tensors (the inputs are not modified)."""
    cos, sin = _rotary_factors(positions, cos_sin, q.dtype, is_neox)
    joint = _adjacent_heads(q, k)
    if joint is not None:
        out = _rotate(joint, cos, sin, is_neox)
        return out[:, : q.shape[1]], out[:, q.shape[1] :]
    return _rotate(q, cos, sin, is_neox), _rotate(k, cos, sin, is_neox)


# ---- MoE -----------------------------------------------------------------------------


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Mixture-of-experts MLP, reference form (``FusedMoEOp`` in the contract):
    y[t] = sum_k w[t, k] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = ids[t, k].

    x [T, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I];
    topk_weights / topk_ids [T, K]. The (token, k) pairs are sorted by expert
    once, the tokens gathered once in that order, and each expert that got
    tokens runs one GEMM pair over its contiguous group; experts with no
    tokens cost nothing. Ids outside [0, E) (other ranks' experts, padding)
    are skipped. The weighted sum accumulates in float32; returns x's dtype.
    """
    return _fused_moe(x, w13, w2, topk_weights, topk_ids, linear)


def fused_moe_rowwise(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """fused_moe for deterministic mode: the experts' GEMMs by
    ``linear_rowwise``; each token's weighted sum already runs in one order
    (its experts by id)."""
    return _fused_moe(x, w13, w2, topk_weights, topk_ids, linear_rowwise)


def _fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, linear: Callable[..., torch.Tensor]) -> torch.Tensor:
    num_experts = w13.shape[0]
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros(num_tokens, w2.shape[1], dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1).long()
    bucket = torch.where((flat_ids >= 0) & (flat_ids < num_experts), flat_ids, num_experts)  # skipped pairs last
    order = torch.argsort(bucket, stable=True)
    counts = torch.bincount(bucket, minlength=num_experts + 1).tolist()  # the one host sync
    routed = sum(counts[:num_experts])
    if routed == 0:
        return out.to(x.dtype)
    order = order[:routed]
    tokens = order // top_k
    grouped = x.index_select(0, tokens)
    ys = torch.empty(routed, w2.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for e, count in enumerate(counts[:num_experts]):
        if count == 0:
            continue
        seg = slice(start, start + count)
        ys[seg] = linear(silu_and_mul(linear(grouped[seg], w13[e])), w2[e])
        start += count
    weights = topk_weights.reshape(-1).index_select(0, order).to(torch.float32).unsqueeze(1)
    out.index_add_(0, tokens, ys.to(torch.float32) * weights)
    return out.to(x.dtype)
