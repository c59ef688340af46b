"""The torch backend's dense ops against straightforward references."""

from __future__ import annotations

import importlib
import math

import dense_reference as ref
import pytest
import torch
import torch.nn.functional as F
from plinth.api import OP_NAMES, AttentionBackend, QuantizedWeight, SelectionContext
from plinth_plugin_torch import ops
from plinth_plugin_torch.backend import TorchBackend


def test_backend_implements_every_op():
    table = TorchBackend(SelectionContext()).ops()
    assert set(table) == set(OP_NAMES)
    assert all(callable(f) for f in table.values())
    assert TorchBackend.check(SelectionContext()) == []
    for mode in (False, True):  # and paged attention, the reference of every backend
        attention = TorchBackend.attention_backend(SelectionContext(deterministic=mode))
        assert issubclass(attention, AttentionBackend) and attention.problems(SelectionContext(page_size=7)) == []


def test_entry_point_module_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, plinth_plugin_torch.plugin as p; p.plinth_register_backends(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize("rows", [1, 3, 200])  # 200 x 96 x 4 > the small-input path's limit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_paths_agree(dtype, rows):
    g = torch.Generator().manual_seed(8)
    x = (torch.randn(rows, 4, 96, generator=g) * 0.01).to(dtype)  # small values: eps matters
    w = torch.randn(96, generator=g).to(dtype)
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    out = ops.rms_norm(x, w, 1e-4)
    assert out.is_contiguous() and out.shape == x.shape
    torch.testing.assert_close(out.double(), ref.rms_norm(x, w, 1e-4), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_fused_residual(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 96, generator=g).to(dtype)
    r = torch.randn(7, 96, generator=g).to(dtype)
    w = (torch.rand(96, generator=g) + 0.5).to(dtype)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6).double(), ref.rms_norm(x, w, 1e-6), **tol)
    y, summed = ops.rms_norm(x, w, 1e-6, residual=r)
    torch.testing.assert_close(summed, x + r)
    torch.testing.assert_close(y.double(), ref.rms_norm(x + r, w, 1e-6), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_linear(dtype, rows):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, 80, generator=g).to(dtype)
    w = torch.randn(48, 80, generator=g).to(dtype)
    b = torch.randn(48, generator=g).to(dtype)
    expected = x.double() @ w.double().T
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.15, rtol=2e-2)
    torch.testing.assert_close(ops.linear(x, w).double(), expected, **tol)
    torch.testing.assert_close(ops.linear(x, w, b).double(), expected + b.double(), **tol)
    # 3-D input keeps its leading dims
    assert ops.linear(x.view(1, rows, 80), w).shape == (1, rows, 48)


def test_pack_linear_is_the_identity():
    w = torch.randn(4, 8).bfloat16()
    assert ops.pack_linear(w) is w
    qw = QuantizedWeight("int8", torch.zeros(4, 8, dtype=torch.int8), torch.ones(4), (4, 8))
    assert ops.pack_linear(qw) is qw


def _fp8(w, scale):
    return (w / scale).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_fp8_per_channel(dtype):
    g = torch.Generator().manual_seed(2)
    w = torch.randn(24, 40, generator=g)
    scale = w.abs().amax(1) / 448
    qw = QuantizedWeight("fp8_e4m3", _fp8(w, scale[:, None]), scale, (24, 40))
    dense = qw.qweight.float() * scale[:, None]
    x = torch.randn(3, 40, generator=g).to(dtype)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=2e-2)
    torch.testing.assert_close(ops.linear(x, qw).double(), (x.double() @ dense.to(dtype).double().T), **tol)
    assert ops.dequantize_weight(qw, dtype).dtype == dtype


def test_linear_fp8_block_scales():
    g = torch.Generator().manual_seed(3)
    n, k, bn, bk = 40, 70, 16, 32  # ragged last blocks
    w = torch.randn(n, k, generator=g)
    sn, sk = math.ceil(n / bn), math.ceil(k / bk)
    scale = torch.rand(sn, sk, generator=g) + 0.1
    full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    qw = QuantizedWeight("fp8_e4m3", _fp8(w, full), scale, (n, k), block_size=(bn, bk))
    dense = qw.qweight.float() * full
    x = torch.randn(2, k, generator=g)
    torch.testing.assert_close(ops.linear(x, qw), x @ dense.T, atol=1e-4, rtol=1e-4)


def test_linear_int8_and_unknown_format():
    w = torch.randint(-127, 128, (8, 12), dtype=torch.int8)
    scale = torch.rand(8) + 0.5
    x = torch.randn(2, 12)
    qw = QuantizedWeight("int8", w, scale, (8, 12))
    torch.testing.assert_close(ops.linear(x, qw), x @ (w.float() * scale[:, None]).T, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="unsupported quantized weight format"):
        ops.linear(x, QuantizedWeight("nf4", w, scale, (8, 12)))


def test_silu_and_mul():
    x = torch.randn(5, 2 * 24)
    torch.testing.assert_close(ops.silu_and_mul(x), F.silu(x[:, :24]) * x[:, 24:])


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("rotary_dim", [32, 16], ids=["full", "partial"])
def test_rotary(is_neox, rotary_dim):
    g = torch.Generator().manual_seed(4)
    head_dim, max_pos = 32, 300
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    angles = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq
    cos_sin = torch.cat((angles.cos(), angles.sin()), -1)
    positions = torch.tensor([0, 1, 7, 299, 5, 128])
    q = torch.randn(6, 4, head_dim, generator=g)
    k = torch.randn(6, 2, head_dim, generator=g)
    q2, k2 = ops.rotary(q, k, positions, cos_sin, is_neox)
    torch.testing.assert_close(q2.double(), ref.rotary(q, positions, inv_freq, rotary_dim, is_neox), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(k2.double(), ref.rotary(k, positions, inv_freq, rotary_dim, is_neox), atol=1e-4, rtol=1e-4)
    # a second call with other positions must not reuse the first step's rows
    p2 = (positions + 1) % max_pos
    q3, _ = ops.rotary(q, k, p2, cos_sin, is_neox)
    torch.testing.assert_close(q3.double(), ref.rotary(q, p2, inv_freq, rotary_dim, is_neox), atol=1e-4, rtol=1e-4)
    # a positions buffer refilled in place is noticed too
    p2.copy_(positions)
    q4, _ = ops.rotary(q, k, p2, cos_sin, is_neox)
    torch.testing.assert_close(q4, q2)
    if rotary_dim == head_dim:  # flat [T, H * D] input
        qf, kf = ops.rotary(q.flatten(1), k.flatten(1), positions, cos_sin, is_neox)
        torch.testing.assert_close(qf.view_as(q), q2)


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
def test_rotary_of_adjacent_q_and_k_views(is_neox):
    """q and k as views of one fused projection are rotated in one go; the
    result must equal rotating them separately, and the input stays as is."""
    g = torch.Generator().manual_seed(7)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    angles = torch.arange(50, dtype=torch.float32)[:, None] * inv_freq
    cos_sin = torch.cat((angles.cos(), angles.sin()), -1)
    qkv = torch.randn(5, (4 + 2 + 2) * 16, generator=g)
    before = qkv.clone()
    q, k, _ = qkv.split((64, 32, 32), -1)
    q, k = q.view(5, 4, 16), k.view(5, 2, 16)
    assert ops._adjacent_heads(q, k) is not None
    positions = torch.tensor([0, 3, 9, 10, 49])
    q2, k2 = ops.rotary(q, k, positions, cos_sin, is_neox)
    torch.testing.assert_close(q2.double(), ref.rotary(q, positions, inv_freq, 16, is_neox), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k2.double(), ref.rotary(k, positions, inv_freq, 16, is_neox), atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv, before)
    assert ops._adjacent_heads(q, k.clone()) is None and ops._adjacent_heads(k, q) is None


def test_copy_pages():
    from plinth.api import SelectionContext
    from plinth_plugin_torch.attention import TorchAttention, token_major

    attention = TorchAttention(SelectionContext())
    k, v = attention.allocate(num_pages=10, page_size=4, num_kv_heads=2, head_dim=8, v_head_dim=8, dtype=torch.float32, device=torch.device("cpu"))
    assert v is not None and k.shape == (2, 10, 4, 8)
    k.normal_()
    v.normal_()
    k0, v0 = token_major(k).clone(), token_major(v).clone()
    attention.copy_pages([(k, v)], torch.tensor([1, 3]), torch.tensor([7, 2]))
    torch.testing.assert_close(token_major(k)[7], k0[1])
    torch.testing.assert_close(token_major(v)[2], v0[3])
    torch.testing.assert_close(token_major(k)[0], k0[0])
    attention.copy_pages([(k, v)], torch.tensor([0]), torch.tensor([9]))
    torch.testing.assert_close(token_major(k)[9], k0[0])


def test_fused_moe_matches_per_token_loop():
    g = torch.Generator().manual_seed(5)
    t, h, inter, e, topk = 9, 16, 12, 6, 2
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * inter, h, generator=g) / 4
    w2 = torch.randn(e, h, inter, generator=g) / 4
    logits = torch.randn(t, e, generator=g)
    weights, ids = torch.topk(logits.softmax(-1), topk)
    ids[0, 1] = e + 3  # an expert of another rank: skipped
    out = ops.fused_moe(x, w13, w2, weights, ids)
    expected = torch.zeros(t, h, dtype=torch.float64)
    for i in range(t):
        for j in range(topk):
            ex = int(ids[i, j])
            if ex >= e:
                continue
            gu = w13[ex].double() @ x[i].double()
            act = F.silu(gu[:inter]) * gu[inter:]
            expected[i] += weights[i, j].double() * (w2[ex].double() @ act)
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)


def test_fused_moe_one_gemm_pair_per_expert_with_tokens(monkeypatch):
    """Tokens grouped by expert: each expert that got tokens runs one GEMM
    pair over all of them, an expert with none runs nothing; -1 ids
    (padding, other ranks) are skipped."""
    g = torch.Generator().manual_seed(7)
    t, h, inter, e = 12, 16, 8, 8
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * inter, h, generator=g) / 4
    w2 = torch.randn(e, h, inter, generator=g) / 4
    ids = torch.tensor([[1, 5], [5, 1], [1, -1]] * 4)  # only experts 1 and 5
    weights = torch.rand(t, 2, generator=g)
    rows = []
    real_linear = ops.linear

    def counting_linear(a, w, bias=None):
        rows.append(a.shape[0])
        return real_linear(a, w, bias)

    monkeypatch.setattr(ops, "linear", counting_linear)
    out = ops.fused_moe(x, w13, w2, weights, ids)
    assert rows == [12, 12, 8, 8]  # expert 1: 12 tokens (gate/up, then down), expert 5: 8
    expected = torch.zeros(t, h)
    for i in range(t):
        for j in range(2):
            ex = int(ids[i, j])
            if ex < 0:
                continue
            gu = w13[ex] @ x[i]
            expected[i] += weights[i, j] * (w2[ex] @ (F.silu(gu[:inter]) * gu[inter:]))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    rows.clear()
    assert ops.fused_moe(x, w13, w2, weights, torch.full_like(ids, -1)).abs().max() == 0 and rows == []


def test_module_reload_keeps_op_names():
    # the op table is built from module attributes; a reload must still work
    importlib.reload(ops)
    assert callable(ops.linear)


def test_ops_under_inference_mode():
    """Inference tensors keep no version counter: the caches must not need one."""
    with torch.inference_mode():
        inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
        angles = torch.arange(64, dtype=torch.float32)[:, None] * inv_freq
        cos_sin = torch.cat((angles.cos(), angles.sin()), -1)
        positions = torch.tensor([3, 9])
        q, k = torch.randn(2, 2, 16), torch.randn(2, 1, 16)
        q1, _ = ops.rotary(q, k, positions, cos_sin, True)
        positions.copy_(torch.tensor([4, 10]))  # a refilled buffer: must not reuse stale rows
        ops.new_step()  # (the attention backend's build_plan marks the next step)
        q2, _ = ops.rotary(q, k, positions, cos_sin, True)
        torch.testing.assert_close(q2.double(), ref.rotary(q, positions, inv_freq, 16, True), atol=1e-4, rtol=1e-4)
        assert not torch.allclose(q1, q2)
        w = torch.randn(8, 16).bfloat16()
        x = torch.randn(2, 16).bfloat16()
        torch.testing.assert_close(ops.linear(x, ops.pack_linear(w)).float(), F.linear(x, w).float())
