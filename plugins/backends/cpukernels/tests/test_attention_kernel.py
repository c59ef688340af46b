"""The C++ paged-decode kernel against the reference backend's attention, on
the same pages: decode batches of mixed lengths, GQA/MQA, sliding windows,
odd page sizes, bfloat16 and float32; short multi-token queries (speculative
scoring) per token through the kernel; long prefill chunks to the reference."""

import pytest
import torch
from plinth.api import SelectionContext, load_accelerator
from plinth.testing import attention_backend, random_attention_metadata


@pytest.fixture(scope="module")
def ops():
    """(the reference's attention backend, cpukernels'), as start-up builds them (compiles the kernel once)."""
    ctx = SelectionContext(accelerator=load_accelerator("cpu"))
    mine = attention_backend(ctx, "cpukernels")
    assert type(mine).__name__ == "CPUKernelsAttention"
    return mine.reference, mine


def _batch(query_lens, seq_lens, *, page_size, num_kv, num_heads, dim, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    meta, num_pages = random_attention_metadata(query_lens, seq_lens, page_size, g, spare_pages=3)
    t = sum(query_lens)
    q = torch.randn(t, num_heads, dim, generator=g).to(dtype)
    k = torch.randn(t, num_kv, dim, generator=g).to(dtype)
    v = torch.randn(t, num_kv, dim, generator=g).to(dtype)
    return meta, q, k, v, num_pages


def _run(attention, meta, q, k, v, num_pages, *, page_size, num_kv, dim, dtype, window, fill_seed):
    cache = attention.allocate(
        num_pages=num_pages, page_size=page_size, num_kv_heads=num_kv, head_dim=dim, v_head_dim=dim, dtype=dtype,
        device=torch.device("cpu"),
    )
    g = torch.Generator().manual_seed(fill_seed)
    for pages in cache:  # the cached context: the same random history for both
        pages.copy_(torch.randn(pages.shape, generator=g).to(dtype))
    meta.plan = attention.build_plan(meta)
    return attention.forward(q, k, v, cache, meta, scale=dim**-0.5, sliding_window=window), cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [16, 7, 1])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (8, 1)], ids=["gqa3", "mha", "mqa"])
@pytest.mark.parametrize("window", [None, 5])
def test_decode_kernel_matches_reference(ops, dtype, page_size, heads, window):
    reference, table = ops
    num_heads, num_kv = heads
    seq_lens = [1, 2, 17, 64, 100, 33, 7]
    meta, q, k, v, n = _batch([1] * len(seq_lens), seq_lens, page_size=page_size, num_kv=num_kv, num_heads=num_heads, dim=64, dtype=dtype, seed=1)
    kw = dict(page_size=page_size, num_kv=num_kv, dim=64, dtype=dtype, window=window, fill_seed=2)
    ours, our_cache = _run(table, meta, q, k, v, n, **kw)
    ref, ref_cache = _run(reference, meta, q, k, v, n, **kw)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(ours.float(), ref.float(), **tol)
    for a, b in zip(our_cache, ref_cache):  # the new K/V landed in the same slots
        torch.testing.assert_close(a, b)


def test_long_prefill_chunks_run_in_the_kernel(ops):
    """A 40-token prefill chunk beside two decodes: the kernel's rows match
    the reference's SDPA to float32 rounding, and are not its bits (the
    kernel, not the reference, ran them)."""
    reference, table = ops
    kw = dict(page_size=16, num_kv=3, dim=64, dtype=torch.float32, window=None, fill_seed=3)
    meta, q, k, v, n = _batch([40, 1, 1], [40, 20, 9], page_size=16, num_kv=3, num_heads=9, dim=64, dtype=torch.float32, seed=4)
    ours, _ = _run(table, meta, q, k, v, n, **kw)
    ref, _ = _run(reference, meta, q, k, v, n, **kw)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    assert not torch.equal(ours[:40], ref[:40])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [16, 7])
@pytest.mark.parametrize("window", [None, 5])
def test_short_queries_run_per_token_through_the_kernel(ops, dtype, page_size, window):
    """A decode scoring speculative proposals (1 + k query tokens, next to
    plain decodes and a short prefill) is causal per token and goes to the
    kernel, one row per query token, never to the reference."""
    reference, _ = ops
    counted = attention_backend(SelectionContext(accelerator=load_accelerator("cpu")), "cpukernels")
    kernels = counted.kernels
    rows, ref_calls = [], []

    class CountingKernels:
        def paged_attention(self, q, *args):
            rows.append(q.shape[0])
            return kernels.paged_attention(q, *args)

        def zeros_on_large_pages(self, *args):
            return kernels.zeros_on_large_pages(*args)

    class CountingReference:
        def build_plan(self, meta):
            return reference.build_plan(meta)

        def forward(self, *args, **kw):
            ref_calls.append(1)
            return reference.forward(*args, **kw)

    counted.kernels, counted.reference_attention = CountingKernels(), CountingReference()
    query_lens, seq_lens = [5, 1, 3, 1, 4], [40, 20, 9, 3, 4]
    meta, q, k, v, n = _batch(query_lens, seq_lens, page_size=page_size, num_kv=3, num_heads=9, dim=64, dtype=dtype, seed=5)
    kw = dict(page_size=page_size, num_kv=3, dim=64, dtype=dtype, window=window, fill_seed=6)
    ours, our_cache = _run(counted, meta, q, k, v, n, **kw)
    ref, ref_cache = _run(reference, meta, q, k, v, n, **kw)
    assert rows == [sum(query_lens)] and not ref_calls
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(ours.float(), ref.float(), **tol)
    for a, b in zip(our_cache, ref_cache):
        torch.testing.assert_close(a, b)


def _float64_attention(q, kp, vp, tables, lens, scale, window):
    """softmax(q k^T * scale) v per sequence and head, in float64, over the
    rows the block tables name (the last ``window`` positions when set)."""
    B, Hq, D = q.shape
    Hkv, _, ps, _ = kp.shape
    Dv, G = vp.shape[-1], Hq // Hkv
    out = torch.zeros(B, Hq, Dv, dtype=torch.float64)
    for b in range(B):
        L = int(lens[b])
        pos = torch.arange(max(0, L - window) if window else 0, L)
        rows = tables[b, pos // ps].long() * ps + pos % ps
        for h in range(Hkv):
            K, V = kp[h].reshape(-1, D)[rows].double(), vp[h].reshape(-1, Dv)[rows].double()
            out[b, h * G : (h + 1) * G] = torch.softmax(q[b, h * G : (h + 1) * G].double() * scale @ K.T, -1) @ V
    return out


#: the vectorized paths (AVX-512 with BF16 dot products, AVX2+FMA), AMX tiles
#: (bf16 pages; the native build with set_amx_attention) and the portable
#: loops (no AVX): each built and checked on its own where the CPU has it
ISA_SETS = {
    "native": None,
    "amx": None,
    "avx2": ("sse4_2", "avx", "avx2", "fma", "f16c"),
    "no-avx": ("sse4_2",),
}


@pytest.fixture(scope="module")
def isa_kernels():
    import platform

    from plinth_plugin_cpukernels.backend import accelerator_isa
    from plinth_plugin_cpukernels.kernels import load_kernels

    native = accelerator_isa(SelectionContext(accelerator=load_accelerator("cpu"))) or ()

    def get(name):
        isa = ISA_SETS[name]
        if isa is None:
            isa = native
        elif platform.machine().lower() not in ("x86_64", "amd64") or not set(isa) <= set(native):
            pytest.skip(f"{name}: an x86 build this CPU runs")
        return load_kernels(isa)  # built once per set

    return get


@pytest.mark.parametrize("isa", list(ISA_SETS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [16, 7])
@pytest.mark.parametrize("dims", [(64, 64), (64, 32), (128, 128), (72, 72)], ids=["d64", "dv32", "d128", "d72"])
@pytest.mark.parametrize("window", [0, 37])
def test_kernel_blocks_against_float64(isa_kernels, attention_path, isa, dtype, page_size, dims, window):
    """Contexts around the kernel's token blocks (8 or 16 rows: 1, 7-9,
    15-17, 31-33, ...), windows that start mid-block, pages that end
    mid-block, V narrower than K, a head size no vector width divides (the
    portable loops), GQA, MHA and MQA, against float64 on the same pages."""
    k = isa_kernels(isa)
    attention_path(isa == "amx")  # "amx" is the native build with the tiles on
    D, Dv = dims
    lens = torch.tensor([1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 64, 100, 129], dtype=torch.int32)
    for num_heads, num_kv in [(9, 3), (4, 4), (8, 1)]:
        g = torch.Generator().manual_seed(num_heads * 100 + page_size)
        pages_per = [-(-int(s) // page_size) for s in lens]
        num_pages = sum(pages_per) + 3
        order = torch.randperm(num_pages, generator=g).tolist()
        tables = torch.zeros(len(lens), max(pages_per), dtype=torch.int32)
        for i, n in enumerate(pages_per):
            tables[i, :n] = torch.tensor([order.pop() for _ in range(n)])
        kp = torch.randn(num_kv, num_pages, page_size, D, generator=g).to(dtype)
        vp = torch.randn(num_kv, num_pages, page_size, Dv, generator=g).to(dtype)
        q = torch.randn(len(lens), num_heads, D, generator=g).to(dtype)
        ours = k.paged_decode_attention(q, kp, vp, tables, lens, D**-0.5, window)
        ref = _float64_attention(q, kp, vp, tables, lens, D**-0.5, window)
        if dtype == torch.float32:
            torch.testing.assert_close(ours.double(), ref, atol=1e-5, rtol=1e-5)
        else:  # the kernel rounds its float32 result to bfloat16 once
            torch.testing.assert_close(ours.double(), ref.to(dtype).double(), atol=2e-2, rtol=2e-2)
