"""Rotary embedding tables, computed once at load.

The inverse frequencies follow transformers' ``modeling_rope_utils``
(default, linear, dynamic NTK, llama3, yarn) operation for operation in
float32, so the tables match transformers' cos/sin exactly.

Dynamic NTK changes the frequencies only beyond ``max_position_embeddings``;
the table stops there (the model's max length), so within it dynamic equals
default, exactly as in transformers.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))


def _llama3(inv_freq: torch.Tensor, rope: Mapping[str, Any]) -> torch.Tensor:
    factor = rope["factor"]
    low_freq_factor = rope["low_freq_factor"]
    high_freq_factor = rope["high_freq_factor"]
    old_context_len = rope["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def _yarn(base: float, dim: int, rope: Mapping[str, Any], max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    factor = rope.get("factor")
    attention_factor = rope.get("attention_factor")
    mscale = rope.get("mscale")
    mscale_all_dim = rope.get("mscale_all_dim")
    original_max = rope["original_max_position_embeddings"]
    if factor is None:
        factor = max_position_embeddings / original_max

    def get_mscale(scale: float, m: float = 1) -> float:
        if scale <= 1:
            return 1.0
        return 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = rope.get("beta_fast") or 32
    beta_slow = rope.get("beta_slow") or 1

    def find_correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low = find_correction_dim(beta_fast)
    high = find_correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # prevent a singularity
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = inv_freq_interpolation * (1 - extrapolation_factor) + inv_freq_extrapolation * extrapolation_factor
    return inv_freq, attention_factor


def inv_freq_and_scaling(
    rope: Mapping[str, Any], rotary_dim: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim / 2] in float32, cos/sin scaling)."""
    base = float(rope.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", "default")
    if kind in ("default", "dynamic"):
        return _default_inv_freq(base, rotary_dim), 1.0
    if kind == "linear":
        return _default_inv_freq(base, rotary_dim) / rope["factor"], 1.0
    if kind == "llama3":
        return _llama3(_default_inv_freq(base, rotary_dim), rope), 1.0
    if kind == "yarn":
        return _yarn(base, rotary_dim, rope, max_position_embeddings)
    raise ValueError(f"rope type {kind!r} is not supported by the llama plugin (default, linear, dynamic, llama3, yarn)")


def cos_sin_table(
    rope: Mapping[str, Any],
    rotary_dim: int,
    max_position_embeddings: int,
    num_positions: int,
    freq_factors: torch.Tensor | None = None,
) -> torch.Tensor:
    """[num_positions, rotary_dim] float32: cos of every position's angles,
    then their sin (the layout the rotary op takes). ``freq_factors``
    (llama.cpp's rope_freqs tensor) divide the base frequencies."""
    inv_freq, scaling = inv_freq_and_scaling(rope, rotary_dim, max_position_embeddings)
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.to(torch.float32)
    positions = torch.arange(num_positions, dtype=torch.float32)
    angles = positions[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos() * scaling, angles.sin() * scaling), dim=-1)
