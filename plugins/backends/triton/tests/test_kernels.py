"""Every Triton kernel against the torch reference backend, in Triton's
interpreter on CPU tensors (conftest sets TRITON_INTERPRET=1): odd page sizes
(7, 48), ragged batches, single tokens, a sequence with no new token (an empty
slot in the batch), split-K over longer contexts, experts with no tokens."""

from __future__ import annotations

import pytest
import torch
from plinth.api import QuantizedWeight, SelectionContext
from plinth.testing import attention_metadata
from plinth_plugin_torch import ops as ref_ops
from plinth_plugin_torch.attention import TorchAttention
from plinth_plugin_triton import fp8, moe, norm
from plinth_plugin_triton.attention import TritonAttention, decode_splits

TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}
REFERENCE = TorchAttention(SelectionContext())


def make_attention() -> TritonAttention:
    return TritonAttention(SelectionContext())


def _step(attention, q, k, v, cache, meta, **kw):
    meta.plan = attention.build_plan(meta)
    return attention.forward(q, k, v, cache, meta, **kw)


def assert_close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str = "") -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    got, want = got.float(), want.float()
    assert torch.isfinite(got).all(), f"{what}: non-finite output"
    err = (got - want).abs()
    bound = tol + tol * want.abs()
    assert bool((err <= bound).all()), f"{what}: max abs diff {float(err.max()):.3g} (tolerance {tol})"


def run_steps(dtype, page_size, heads, dim, tables, steps, *, window=None, cap=None, num_pages=64, seed=0):
    """Both backends through the same steps from empty caches; every output compared."""
    g = torch.Generator().manual_seed(seed)
    num_heads, num_kv = heads
    mine = make_attention()
    caches = [
        attention.allocate(num_pages=num_pages, page_size=page_size, num_kv_heads=num_kv, head_dim=dim, v_head_dim=dim, dtype=dtype, device=torch.device("cpu"))
        for attention in (mine, REFERENCE)
    ]
    for i, seqs in enumerate(steps):
        t = sum(n for _, n in seqs)
        q = torch.randn(t, num_heads, dim, generator=g).to(dtype)
        k = torch.randn(t, num_kv, dim, generator=g).to(dtype)
        v = torch.randn(t, num_kv, dim, generator=g).to(dtype)
        outs = []
        for attention, cache in zip((mine, REFERENCE), caches):
            meta = attention_metadata(seqs, tables[: len(seqs)], page_size, "cpu")
            outs.append(_step(attention, q, k, v, cache, meta, scale=dim**-0.5, sliding_window=window, logit_cap=cap))
        assert_close(outs[0], outs[1], TOL[dtype], f"step {i} {seqs}")
    # the pages themselves: the same K/V written at the same slots
    assert_close(caches[0][0], caches[1][0], 0, "K pages")
    assert_close(caches[0][1], caches[1][1], 0, "V pages")


def _tables(num_pages: int, lens: list[int], page_size: int, seed: int = 1) -> list[list[int]]:
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
    out, at = [], 0
    for n in lens:
        need = -(-n // page_size)
        out.append(perm[at : at + need])
        at += need
    assert at <= num_pages
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [7, 48])
def test_ragged_prefill_then_decode(dtype, page_size):
    """Prefill chunks of 20, 1 (a single-token prompt), 0 (no new token) and 9;
    then a chunk after a cached prefix mixed with decodes; then decode-only
    steps over ragged contexts. GQA 8/2, head dim 40 (not a power of two)."""
    tables = _tables(64, [40, 40, 40, 40], page_size)
    steps = [
        [(0, 20), (0, 1), (0, 0), (0, 9)],
        [(20, 11), (1, 1), (0, 3), (9, 1)],  # prefix + chunk, decode, first chunk, decode
        [(31, 1), (2, 1), (3, 1), (10, 1)],  # decode only
        [(32, 1), (3, 1), (4, 1), (11, 1)],
    ]
    run_steps(dtype, page_size, (8, 2), 40, tables, steps)


@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (9, 3)])
def test_decode_split_k_long_contexts(heads):
    """Contexts long enough for several splits (and a short one whose later
    splits are empty), page size 7, MHA and GQA (group 3: not a power of two)."""
    dim, page_size = 32, 7
    lens = [300, 5, 130]
    splits, split_len = decode_splits(len(lens), max(lens) + 1, heads[1])
    assert splits > 1 and split_len % 64 == 0
    tables = _tables(128, [n + 2 for n in lens], page_size, seed=3)
    steps = [[(0, n) for n in lens], [(n, 1) for n in lens], [(n + 1, 1) for n in lens]]
    run_steps(torch.float32, page_size, heads, dim, tables, steps, num_pages=128)


def test_sliding_window_and_logit_cap():
    tables = _tables(64, [70, 30], 16)
    steps = [[(0, 50), (0, 20)], [(50, 10), (20, 1)], [(60, 1), (21, 1)]]
    run_steps(torch.float32, 16, (4, 2), 32, tables, steps, window=13)
    run_steps(torch.float32, 16, (4, 2), 32, tables, steps, cap=5.0, seed=1)


def test_single_decode_token_and_fork():
    """One sequence of one token; then a fork through copy_pages decodes like its parent."""
    mine = make_attention()
    k_pages, v_pages = mine.allocate(num_pages=8, page_size=7, num_kv_heads=2, head_dim=16, v_head_dim=16, dtype=torch.float32, device=torch.device("cpu"))
    q, k, v = torch.randn(1, 4, 16), torch.randn(1, 2, 16), torch.randn(1, 2, 16)
    meta = attention_metadata([(0, 1)], [[3]], 7, "cpu")
    out = _step(mine, q, k, v, (k_pages, v_pages), meta, scale=0.25)
    # one key: the output is that key's value for each query head of its group
    assert_close(out, v.repeat_interleave(2, 1), 1e-6, "single token")
    mine.copy_pages([(k_pages, v_pages)], torch.tensor([3]), torch.tensor([5]))
    q2 = torch.randn(1, 4, 16).repeat(2, 1, 1)
    k2, v2 = torch.randn(1, 2, 16).repeat(2, 1, 1), torch.randn(1, 2, 16).repeat(2, 1, 1)
    meta = attention_metadata([(1, 1), (1, 1)], [[3], [5]], 7, "cpu")
    out = _step(mine, q2, k2, v2, (k_pages, v_pages), meta, scale=0.25)
    assert_close(out[1], out[0], 1e-6, "fork")


# ---- rms_norm -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm(dtype):
    g = torch.Generator().manual_seed(0)
    for shape in [(1, 64), (7, 96), (2, 3, 40)]:
        x, r = torch.randn(*shape, generator=g).to(dtype), torch.randn(*shape, generator=g).to(dtype)
        w = torch.randn(shape[-1], generator=g).to(dtype)
        assert_close(norm.rms_norm(x, w, 1e-6), ref_ops.rms_norm(x, w, 1e-6), TOL[dtype], f"{shape}")
        y, s = norm.rms_norm(x, w, 1e-6, r)
        y_ref, s_ref = ref_ops.rms_norm(x, w, 1e-6, r)
        assert_close(y, y_ref, TOL[dtype], f"{shape} with residual")
        assert_close(s, s_ref, TOL[dtype], f"{shape} residual sum")
    x = torch.randn(5, 48, generator=g).to(dtype)
    assert_close(norm.rms_norm(x, None, 1e-5), ref_ops.rms_norm(x, None, 1e-5), TOL[dtype], "no weight")
    assert norm.rms_norm(torch.empty(0, 8, dtype=dtype), torch.ones(8, dtype=dtype), 1e-6).shape == (0, 8)


# ---- fused MoE ------------------------------------------------------------------------


def test_align_groups_pairs_by_expert():
    ids = torch.tensor([[2, 0], [2, -1], [7, 2], [0, 9]])  # expert 1 and 3..6 get nothing; -1, 9 other ranks'
    sorted_pairs, block_expert = moe.align(ids, num_experts=8, block_m=4)
    num_pairs = ids.numel()
    rows = sorted_pairs.view(-1, 4)
    seen = []
    for b, e in enumerate(block_expert.tolist()):
        pairs = [p for p in rows[b].tolist() if p < num_pairs]
        if e < 0:
            assert not pairs
            continue
        assert pairs and all(int(ids.view(-1)[p]) == e for p in pairs)
        seen += pairs
    assert sorted(seen) == [0, 1, 2, 4, 5, 6]  # every routed pair once; 3 (-1) and 7 (9) nowhere
    assert sorted(set(e for e in block_expert.tolist() if e >= 0)) == [0, 2, 7]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe(dtype):
    g = torch.Generator().manual_seed(0)
    num_experts, hidden, inter = 8, 48, 40  # I not a multiple of the block
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=g) / 4).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=g) / 4).to(dtype)
    for tokens, top_k, chosen in ((13, 2, 5), (1, 1, 8), (1, 3, 8), (40, 4, 6)):
        x = torch.randn(tokens, hidden, generator=g).to(dtype)
        weights, ids = torch.topk(torch.randn(tokens, chosen, generator=g).softmax(-1), top_k)  # experts >= chosen get nothing
        ids = ids.clone()
        if tokens > 2:
            ids[0, 0], ids[1, -1] = -1, num_experts + 3
        weights = weights.to(dtype)
        assert_close(moe.fused_moe(x, w13, w2, weights, ids), ref_ops.fused_moe(x, w13, w2, weights, ids), TOL[dtype], f"{tokens} tokens top {top_k}")
    x = torch.randn(3, hidden, generator=g).to(dtype)
    out = moe.fused_moe(x, w13, w2, torch.ones(3, 2, dtype=dtype), torch.full((3, 2), -1))
    assert out.shape == (3, hidden) and float(out.abs().max()) == 0
    assert moe.fused_moe(x[:0], w13, w2, torch.ones(0, 2, dtype=dtype), torch.zeros(0, 2, dtype=torch.long)).shape == (0, hidden)


def test_fused_moe_many_experts_few_tokens():
    """A decode-sized batch over 64 experts: the row bound comes from the
    tokens, not the experts; only the chosen experts get blocks."""
    g = torch.Generator().manual_seed(1)
    num_experts, hidden, inter = 64, 32, 16
    w13, w2 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / 4, torch.randn(num_experts, hidden, inter, generator=g) / 4
    x = torch.randn(2, hidden, generator=g)
    ids = torch.tensor([[63, 5, 17], [5, 40, 0]])
    weights = torch.rand(2, 3, generator=g)
    sorted_pairs, block_expert = moe.align(ids, num_experts, 16)
    assert sorted_pairs.numel() <= 6 + 6 * 15 and sorted(set(block_expert.tolist()) - {-1}) == [0, 5, 17, 40, 63]
    assert_close(moe.fused_moe(x, w13, w2, weights, ids), ref_ops.fused_moe(x, w13, w2, weights, ids), 2e-5)


# ---- FP8 ---------------------------------------------------------------------------------


def torch_act_quant(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    pk = -(-k // group) * group
    xp = torch.zeros(m, pk)
    xp[:, :k] = x.float()
    amax = xp.view(m, -1, group).abs().amax(-1).clamp(min=1e-10)
    s = amax / fp8.FP8_MAX
    q = (xp.view(m, -1, group) / s[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(m, pk)[:, :k]
    return q, s


def test_act_quant_matches_torch():
    """Scales exactly; values within one float8_e4m3 step (2^-3 relative):
    the interpreter's float32 -> float8 cast does not round to nearest as
    torch's (and the GPU's) does; the GPU script checks them exactly."""
    x = torch.randn(5, 300) * 3
    q, s = fp8.act_quant(x)
    q_ref, s_ref = torch_act_quant(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 3)
    assert_close(s, s_ref, 1e-6, "scales")
    err = (q.float() - q_ref.float()).abs()
    assert bool((err <= q_ref.float().abs() * 2**-3 + 2**-9).all()), f"fp8 values off by more than one step: {float(err.max())}"
    assert float(q.float().abs().max()) <= 448


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_block_gemms(dtype):
    """A [200, 300] weight in 128x128 blocks (partial blocks at both edges):
    weight-only against the reference's dequantized linear; W8A8 against the
    same quantization done in torch (tight) and against the dense weight
    (within FP8's own error)."""
    g = torch.Generator().manual_seed(0)
    n, k = 200, 300
    dense = torch.randn(n, k, generator=g) * 0.1
    q, s = fp8.quantize_block(dense)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (2, 3)
    qw = QuantizedWeight(format="fp8_e4m3", qweight=q, scale=s, shape=(n, k), block_size=(128, 128))
    for rows in (1, 5, 33):
        x = torch.randn(rows, k, generator=g).to(dtype)
        bias = torch.randn(n, generator=g).to(dtype)
        want = ref_ops.linear(x, qw, bias)
        wo = fp8.pack(qw, "weight_only")
        assert wo.mode == "weight_only"
        assert_close(fp8.linear(x, wo, bias), want, TOL[dtype] * 2, f"weight-only, {rows} rows")
        bits = fp8.pack(qw, "weight_only_bits")  # below sm_89: the bytes as uint8, decoded in the kernel
        assert bits.mode == "weight_only_bits" and bits.qweight.dtype == torch.uint8
        assert_close(fp8.linear(x, bits, bias), want, TOL[dtype] * 2, f"weight-only from bytes, {rows} rows")
        w8 = fp8.pack(qw, "w8a8")
        assert w8.mode == "w8a8"
        got = fp8.linear(x, w8, bias)
        xq, xs = fp8.act_quant(x)  # the kernel's own quantized activations (act_quant is tested above)
        emulated = (xq.float() * xs.repeat_interleave(128, 1)[:, :k]) @ ref_ops.dequantize_weight(qw, torch.float32).T + bias.float()
        assert_close(got, emulated.to(dtype), TOL[dtype] * 2, f"w8a8 vs torch emulation, {rows} rows")
        rel = float((got.float() - want.float()).norm() / want.float().norm())
        assert rel < 0.05, f"w8a8 vs dense: relative error {rel:.3g}"
    x3 = torch.randn(2, 3, k, generator=g).to(dtype)
    assert fp8.linear(x3, fp8.pack(qw, "w8a8")).shape == (2, 3, n)


def test_fp8_per_tensor_and_per_channel():
    g = torch.Generator().manual_seed(2)
    n, k = 72, 96
    dense = torch.randn(n, k, generator=g)
    x = torch.randn(4, k, generator=g)
    s = dense.abs().max() / 448
    per_tensor = QuantizedWeight(format="fp8_e4m3", qweight=(dense / s).to(torch.float8_e4m3fn), scale=s.reshape(()), shape=(n, k))
    sc = dense.abs().amax(1) / 448
    per_channel = QuantizedWeight(format="fp8_e4m3", qweight=(dense / sc[:, None]).to(torch.float8_e4m3fn), scale=sc, shape=(n, k))
    for qw in (per_tensor, per_channel):
        packed = fp8.pack(qw, "w8a8")
        assert packed.mode == "weight_only"  # W8A8 only for 128x128 blocks
        assert_close(fp8.linear(x, packed), ref_ops.linear(x, qw), 2e-5)
        assert_close(fp8.linear(x, fp8.pack(qw, "weight_only_bits")), ref_ops.linear(x, qw), 2e-5)


def test_every_e4m3_byte_decodes_as_torch_does():
    """The in-kernel decode of the uint8 path against torch's float8_e4m3fn
    for all 256 bytes but the two NaNs (an identity weight: y = decode(byte))."""
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    n = codes.numel()
    qw = QuantizedWeight(format="fp8_e4m3", qweight=codes.view(torch.float8_e4m3fn).reshape(1, n), scale=torch.ones(()), shape=(1, n))
    got = fp8.linear(torch.eye(n), fp8.pack(qw, "weight_only_bits"))[:, 0]  # row j picks byte j
    assert torch.equal(got, codes.view(torch.float8_e4m3fn).float())


def _sparse_pool(path, heads: int, pages: int, page_size: int, dim: int) -> torch.Tensor:
    """A [heads, pages, page_size, dim] bf16 page pool over a sparse file:
    addressable like a real pool, costing memory only for the pages touched."""
    n = heads * pages * page_size * dim
    with open(path, "wb") as f:
        f.truncate(n * 2)
    return torch.from_file(str(path), shared=True, size=n, dtype=torch.bfloat16).view(heads, pages, page_size, dim)


def test_offsets_past_2_31_elements_in_one_layers_pool(tmp_path):
    """One layer's pool over 2^31 elements (4 KV heads x 2^21 pages of 16 x 32:
    head 2 starts at element 2^31, head 3 at 3 x 2^30), the sequences' pages
    at the end of it: prefill and decode give what the reference gives on a
    small pool holding the same pages (32-bit offsets would read elsewhere)."""
    heads, page_size, dim, num_pages = (8, 4), 16, 32, 1 << 21
    big = tuple(_sparse_pool(tmp_path / name, heads[1], num_pages, page_size, dim) for name in ("k", "v"))
    assert heads[1] * num_pages * page_size * dim > 2**31 and big[0].stride(0) * (heads[1] - 1) > 2**31
    lens = [40, 23]
    small_tables = _tables(8, lens, page_size)
    big_tables = [[num_pages - 1 - 3 * p for p in table] for table in small_tables]
    mine = make_attention()
    small = REFERENCE.allocate(num_pages=8, page_size=page_size, num_kv_heads=heads[1], head_dim=dim, v_head_dim=dim,
                                           dtype=torch.bfloat16, device=torch.device("cpu"))  # fmt: skip
    g = torch.Generator().manual_seed(3)
    for step, seqs in enumerate([[(0, 39), (0, 22)], [(39, 1), (22, 1)]]):  # a prefill, then a decode step
        t = sum(n for _, n in seqs)
        q, k, v = (torch.randn(t, h, dim, generator=g).to(torch.bfloat16) for h in (heads[0], heads[1], heads[1]))
        outs = []
        for attention, cache, tables in ((mine, big, big_tables), (REFERENCE, small, small_tables)):
            meta = attention_metadata(seqs, tables, page_size, "cpu")
            outs.append(_step(attention, q, k, v, cache, meta, scale=dim**-0.5))
        assert_close(outs[0], outs[1], TOL[torch.bfloat16], f"step {step}")


@pytest.mark.parametrize(
    "capability,fp8_support,path",
    [("sm_80", "weight_only", "weight_only_bits"), ("sm_86", "weight_only", "weight_only_bits"),
     ("sm_89", "weight_only", "weight_only"), ("sm_90", "native", "w8a8")],
)  # fmt: skip
def test_fp8_path_by_gpu_generation(capability, fp8_support, path):
    """A100/A10/3090 (sm_80/86): Triton takes no float8 pointer there, so FP8
    bytes go in as uint8; sm_89 takes float8 pointers; sm_90 runs W8A8."""
    from types import SimpleNamespace

    from plinth.api import AcceleratorInfo, SelectionContext
    from plinth_plugin_triton.backend import fp8_path

    info = AcceleratorInfo(device_type="cuda", dist_backend="nccl", device_count=1, device_name="GPU", capability=capability, fp8=fp8_support)
    chosen, why = fp8_path(SelectionContext(accelerator=SimpleNamespace(info=lambda: info)))
    assert chosen == path, why
    assert capability in why


def test_kernels_are_autotuned_on_a_gpu_and_plain_in_the_interpreter(monkeypatch):
    """On a GPU each kernel kind tries num_warps x num_stages once per model
    shape (sm_80 and sm_90 choose for themselves); the interpreter keeps the
    plain kernel (autotune needs one config there)."""
    import triton
    from plinth_plugin_triton import tuning
    from plinth_plugin_triton.attention import _decode_split_kernel

    assert not isinstance(_decode_split_kernel, triton.runtime.Autotuner)  # TRITON_INTERPRET=1 here
    monkeypatch.delenv("TRITON_INTERPRET")
    tuner = tuning.tuned("moe", key=["hidden", "inter", "BLOCK_M"])(moe._moe_down_kernel)
    assert isinstance(tuner, triton.runtime.Autotuner)
    assert {(c.num_warps, c.num_stages) for c in tuner.configs} == set(tuning.CONFIGS["moe"])
    assert tuner.keys == ["hidden", "inter", "BLOCK_M"]
