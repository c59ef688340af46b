"""Straightforward dense references for the torch backend's ops, in float64."""

from __future__ import annotations

import math

import torch


def rms_norm(x, weight, eps):
    x = x.double()
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return y * weight.double()


def rotary(x, positions, inv_freq, rotary_dim, is_neox):
    """x [T, H, D]; rotates the first rotary_dim features by position * inv_freq."""
    x = x.double()
    out = x.clone()
    for t in range(x.shape[0]):
        angles = positions[t].double() * inv_freq.double()  # [rotary_dim / 2]
        cos, sin = torch.cos(angles), torch.sin(angles)
        for i in range(rotary_dim // 2):
            if is_neox:
                a, b = i, i + rotary_dim // 2
            else:
                a, b = 2 * i, 2 * i + 1
            xa, xb = x[t, :, a], x[t, :, b]
            out[t, :, a] = xa * cos[i] - xb * sin[i]
            out[t, :, b] = xb * cos[i] + xa * sin[i]
    return out


def attention(q, keys, values, query_positions, scale, sliding_window=None, logit_cap=None):
    """One sequence: q [Lq, Hq, D] at query_positions, keys/values [S, Hkv, D]
    for positions 0..S-1. Head h uses KV head h // (Hq / Hkv)."""
    q, keys, values = q.double(), keys.double(), values.double()
    num_heads, num_kv = q.shape[1], keys.shape[1]
    group = num_heads // num_kv
    out = torch.zeros(q.shape[0], num_heads, values.shape[-1], dtype=torch.float64)
    for j in range(q.shape[0]):
        p = int(query_positions[j])
        for h in range(num_heads):
            kv = h // group
            scores = (keys[: p + 1, kv] @ q[j, h]) * scale
            if logit_cap is not None:
                scores = logit_cap * torch.tanh(scores / logit_cap)
            if sliding_window is not None:
                key_pos = torch.arange(p + 1)
                scores = scores.masked_fill(key_pos <= p - sliding_window, -math.inf)
            weights = torch.softmax(scores, 0)
            out[j, h] = weights @ values[: p + 1, kv]
    return out
