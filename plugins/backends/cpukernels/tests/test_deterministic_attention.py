"""--deterministic attention on the cpukernels backend: one sequence's rows
computed as a one-token decode, a speculative verification's k + 1 rows, a
row of a prefill chunk of any length chunked anywhere (later chunks reading
the earlier K/V from the pages, as after a prefix-cache hit), at page sizes
16 and 7, alone or among other sequences, are bit-identical
(``plinth.testing.invariance``), bf16 and float32, GQA, with and without a
sliding window, for ``forward`` and the fused block (``qkv_fusion()``).

Before this mode existed, steps with a prefill chunk longer than 16 tokens
went to the reference's SDPA: in bfloat16, 74 of 75 prefill rows differed
from the decode rows, and 11 of 75 decode rows differed when another
sequence's chunk shared the step. Now the kernel takes every step in both
modes (it is faster than SDPA on prefill too); the reference's default
attention still routes prefill to SDPA, which
``test_default_mode_attends_with_the_same_kernel`` shows the harness
catching (so the check can fail)."""

import pytest
import torch
from plinth.api import SelectionContext, load_accelerator
from plinth.testing import attention_backend, attention_metadata
from plinth.testing.invariance import InvarianceCase, attention_invariance_problems

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tables():
    acc = load_accelerator("cpu")
    built = {}

    def get(dtype, deterministic):
        key = (dtype, deterministic)
        if key not in built:
            built[key] = attention_backend(SelectionContext(accelerator=acc, dtype=dtype, deterministic=deterministic), "cpukernels")
        return built[key]

    return get


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("fused", [False, True], ids=["forward", "qkv_fusion"])
@pytest.mark.parametrize("amx", [False, True], ids=["vector", "amx"])
def test_rows_are_bit_identical_every_way(tables, attention_path, dtype, window, fused, amx):
    ops = tables(dtype, True)
    if amx and dtype != torch.bfloat16:
        pytest.skip("AMX tiles take bf16 pages only")
    attention_path(amx)
    case = InvarianceCase(length=50, window=window, fused=fused)
    problems = attention_invariance_problems(ops, dtype, CPU, case=case)
    assert not problems, "\n".join(problems)


def test_rows_are_bit_identical_past_one_pass_of_keys(tables, attention_path):
    """300 positions: the AMX path's weighted sum carries its C tiles across
    passes of 256 keys (the vector path carries nothing); rows still equal
    every way."""
    ops = tables(torch.bfloat16, True)
    attention_path(True)
    case = InvarianceCase(length=300)
    problems = attention_invariance_problems(ops, torch.bfloat16, CPU, page_sizes=(16,), case=case)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("fused", [False, True], ids=["forward", "qkv_fusion"])
def test_default_mode_attends_with_the_same_kernel(tables, fused):
    """The kernel takes every step in both modes (it beats SDPA on prefill
    too), so the default mode's attention is as batch-invariant and gives
    the deterministic mode's bits."""
    case = InvarianceCase(length=50, fused=fused)
    assert not attention_invariance_problems(tables(torch.bfloat16, False), torch.bfloat16, CPU, case=case)
    if not fused:  # the reference has no fused block
        sdpa = attention_backend(SelectionContext(accelerator=load_accelerator("cpu"), dtype=torch.bfloat16, deterministic=False), "torch")
        problems = attention_invariance_problems(sdpa, torch.bfloat16, CPU, case=case)
        assert any(p.startswith("prefill, page size 16") for p in problems), problems
    meta = attention_metadata([(0, 40), (20, 1)], [[0, 1, 2], [3, 4]], 16, CPU)
    outs = []
    for deterministic in (False, True):
        attention = tables(torch.bfloat16, deterministic)
        k_pages, v_pages = attention.allocate(num_pages=8, page_size=16, num_kv_heads=3, head_dim=64, v_head_dim=64, dtype=torch.bfloat16, device=CPU)
        g = torch.Generator().manual_seed(9)
        q, k, v = (torch.randn(41, h, 64, generator=g).to(torch.bfloat16) for h in (9, 3, 3))
        meta.plan = attention.build_plan(meta)
        outs.append(attention.forward(q, k, v, (k_pages, v_pages), meta, scale=0.125))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [0, 37])
@pytest.mark.parametrize("amx", [False, True], ids=["vector", "amx"])
def test_prefill_tiles_against_float64(native_kernels, attention_path, dtype, window, amx):
    """The kernel's prefill path (tiles of query rows over shared key blocks)
    is right, not only invariant: chunks after cached prefixes of several
    lengths, against softmax(q k^T) v in float64 over the same pages, on
    vector registers and (bf16 pages, where the CPU has them) AMX tiles."""
    kernels = native_kernels
    attention_path(amx)
    g = torch.Generator().manual_seed(7)
    page_size, hq, hkv, d = 7, 9, 3, 64
    seqs = [(0, 50), (13, 20), (40, 1), (0, 3), (90, 17), (250, 30)]  # (cached, new); 280 keys: two AMX passes
    pages_per = [-(-(c + n) // page_size) for c, n in seqs]
    order = torch.randperm(sum(pages_per), generator=g).tolist()
    page_lists = [[order.pop() for _ in range(p)] for p in pages_per]
    meta = attention_metadata(seqs, page_lists, page_size, CPU)
    kp = torch.randn(hkv, sum(pages_per), page_size, d, generator=g).to(dtype)
    vp = torch.randn(hkv, sum(pages_per), page_size, d, generator=g).to(dtype)
    q = torch.randn(meta.positions.numel(), hq, d, generator=g).to(dtype)
    out = kernels.paged_attention(q, kp, vp, meta.block_tables, meta.query_start_loc, meta.seq_lens, d**-0.5, window)
    row = 0
    for (cached, n), pages in zip(seqs, page_lists):
        for pos in range(cached, cached + n):
            keys = torch.arange(max(0, pos + 1 - window) if window else 0, pos + 1)
            slots = torch.tensor(pages)[keys // page_size] * page_size + keys % page_size
            k_rows = kp.reshape(hkv, -1, d)[:, slots].double().repeat_interleave(hq // hkv, 0)  # [Hq, n, D]
            v_rows = vp.reshape(hkv, -1, d)[:, slots].double().repeat_interleave(hq // hkv, 0)
            scores = (q[row].double() * d**-0.5).unsqueeze(1) @ k_rows.transpose(1, 2)  # [Hq, 1, n]
            want = (torch.softmax(scores, -1) @ v_rows).squeeze(1)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(out[row].double(), want.to(dtype).double(), atol=tol, rtol=tol)
            row += 1


def test_deterministic_mode_keeps_its_attention():
    from plinth_plugin_cpukernels.attention import CPUKernelsAttention
    from plinth_plugin_cpukernels.backend import CPUKernelsBackend

    ctx = SelectionContext(accelerator=load_accelerator("cpu"), dtype=torch.bfloat16, deterministic=True, page_size=7)
    assert CPUKernelsBackend.attention_backend(ctx) is CPUKernelsAttention and CPUKernelsAttention.problems(ctx) == []


@pytest.mark.parametrize("env", ["", "1"], ids=["default", "amx-attention"])
def test_amx_attention_follows_the_environment(native_kernels, attention_path, env, monkeypatch):
    """PLINTH_CPU_AMX_ATTENTION=1 puts the backend's attention on AMX tiles
    where the linears have them; by default it stays on vector registers
    (the two paths' bits differ, so the output tells which ran)."""
    from plinth_plugin_cpukernels.backend import AMX_ATTENTION_ENV, accelerator_isa, amx_tiles

    monkeypatch.setenv(AMX_ATTENTION_ENV, env)
    ctx = SelectionContext(accelerator=load_accelerator("cpu"), dtype=torch.bfloat16, deterministic=True)
    attention = attention_backend(ctx, "cpukernels")
    tiles = amx_tiles(accelerator_isa(ctx))
    if not tiles:
        pytest.skip("no AMX tiles here: the two paths are one")
    meta = attention_metadata([(0, 40), (30, 1)], [[0, 1, 2], [3, 4]], 16, CPU)
    k_pages, v_pages = attention.allocate(num_pages=8, page_size=16, num_kv_heads=3, head_dim=64, v_head_dim=64, dtype=torch.bfloat16, device=CPU)
    g = torch.Generator().manual_seed(3)
    k_pages.copy_(torch.randn(k_pages.shape, generator=g).to(torch.bfloat16))
    v_pages.copy_(torch.randn(v_pages.shape, generator=g).to(torch.bfloat16))
    q = torch.randn(41, 9, 64, generator=g).to(torch.bfloat16)
    meta.plan = attention.build_plan(meta)
    got = attention.forward(q, q[:, :3], q[:, 3:6], (k_pages, v_pages), meta, scale=0.1)
    k_after, v_after = k_pages.clone(), v_pages.clone()  # with this step's K/V written
    paths = {}
    for on in (False, True):
        attention_path(on)
        paths[on] = native_kernels.paged_attention(q, k_after, v_after, meta.block_tables, meta.query_start_loc, meta.seq_lens, 0.1, 0)
    assert not torch.equal(paths[False], paths[True])
    assert torch.equal(got, paths[env == "1"])
