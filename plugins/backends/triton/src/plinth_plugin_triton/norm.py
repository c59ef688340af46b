"""rms_norm with the residual add fused: one program per row reads x (and the
residual), writes the sum back as the new residual stream and the normed row,
in one pass over memory instead of the reference's add + norm."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    X, R, W, Y, RES_OUT,
    stride_x, stride_r, stride_y, stride_ro,
    n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x = x + tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        # the stream carries the activation dtype, as the reference's x + residual does
        x = x.to(RES_OUT.dtype.element_ty)
        tl.store(RES_OUT + row * stride_ro + cols, x, mask=mask)
        x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n_cols + eps)
    y = x * rstd
    if HAS_WEIGHT:
        y = y * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None = None):
    """``RmsNormOp``: y = x / rms(x) * weight; with ``residual``: (y, x + residual)."""
    shape = x.shape
    d = shape[-1]
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    y = torch.empty((rows, d), dtype=x.dtype, device=x.device)
    res_out = None
    r2 = x2
    if residual is not None:
        r2 = residual.reshape(-1, d)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        res_out = torch.empty((rows, d), dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    if rows:
        _rms_norm_kernel[(rows,)](
            x2, r2, weight if weight is not None else x2, y, res_out if res_out is not None else y,
            x2.stride(0), r2.stride(0), y.stride(0), (res_out if res_out is not None else y).stride(0),
            d, float(eps),
            HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None,
            BLOCK=triton.next_power_of_2(d),
        )
    y = y.view(shape)
    if residual is not None:
        return y, res_out.view(shape)
    return y
