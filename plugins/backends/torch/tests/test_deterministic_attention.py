"""--deterministic attention on the torch reference backend (the fallback
of every backend): rows computed every way a server computes them are
bit-identical (``plinth.testing.invariance``: decode, verification, prefill
chunked anywhere with earlier K/V from the pages, page sizes 16 and 7, among
other sequences), bf16 and float32, GQA, with and without a sliding window;
and it computes attention (against the default path, within tolerance,
soft-capped logits too).

The default path is not invariant (a decode row goes through the padded
matmuls, a prefill row through SDPA): in bfloat16, 12 of the harness's ways
differed from one-token decode, which ``test_default_mode_is_not_batch_invariant``
keeps showing."""

import pytest
import torch
from plinth.api import SelectionContext
from plinth.testing import attention_metadata
from plinth.testing.invariance import InvarianceCase, attention_invariance_problems
from plinth_plugin_torch.backend import TorchBackend

CPU = torch.device("cpu")


def _attention(dtype, deterministic):
    ctx = SelectionContext(dtype=dtype, deterministic=deterministic)
    return TorchBackend.attention_backend(ctx)(ctx)


@pytest.mark.parametrize("dtype,window", [(torch.bfloat16, None), (torch.float32, 20)])
def test_rows_are_bit_identical_every_way(dtype, window):
    problems = attention_invariance_problems(_attention(dtype, True), dtype, CPU, case=InvarianceCase(length=40, window=window))
    assert not problems, "\n".join(problems)


def test_default_mode_is_not_batch_invariant():
    problems = attention_invariance_problems(_attention(torch.bfloat16, False), torch.bfloat16, CPU, case=InvarianceCase(length=40))
    assert any(p.startswith("prefill, page size 16") for p in problems), problems


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,cap", [(None, None), (9, None), (None, 5.0)])
def test_matches_the_default_path(dtype, window, cap):
    """A prefill from 0, a chunk after a cached prefix next to a decode, then
    decodes: the batch-invariant form gives the default path's attention."""
    g = torch.Generator().manual_seed(3)
    hq, hkv, d, ps = 6, 2, 32, 7
    pages = torch.randperm(40, generator=g).tolist()
    tables = [pages[:20], pages[20:]]
    det, ref = _attention(dtype, True), _attention(dtype, False)
    caches = [a.allocate(num_pages=40, page_size=ps, num_kv_heads=hkv, head_dim=d, v_head_dim=d, dtype=dtype, device=CPU) for a in (det, ref)]
    for seqs in ([(0, 30), (0, 5)], [(30, 9), (5, 1)], [(39, 1), (6, 1)]):
        t = sum(n for _, n in seqs)
        q, k, v = (torch.randn(t, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv))
        outs = []
        for attention, cache in zip((det, ref), caches):
            meta = attention_metadata(seqs, tables, ps, CPU)
            meta.plan = attention.build_plan(meta)
            outs.append(attention.forward(q, k, v, cache, meta, scale=d**-0.5, sliding_window=window, logit_cap=cap))
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=tol, rtol=tol)
