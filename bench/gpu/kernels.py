"""The triton backend's kernels on a GPU: each checked against the torch
reference backend, then timed against its roofline or its peer. One command,
one table; exit status 1 on any mismatch.

    .venv/bin/python bench/gpu/kernels.py              # CUDA (an H200: about 3-5 minutes)
    .venv/bin/python bench/gpu/kernels.py --dry-run    # the same code on CPU under TRITON_INTERPRET=1, tiny shapes

Rows (targets from issue 10):

* copy bandwidth: a 1 GiB ``copy_`` (bytes read + written), measured in this run
* decode attention, batch 64 x 4k-token contexts, GQA 32/8, head dim 128,
  page 16: K+V bytes read per second; target >= 80 % of the copy bandwidth
* prefill attention over a cached prefix (ragged): checked, timed
* rms_norm with residual: checked, GB/s
* fused MoE at Qwen3-30B-A3B shapes (H 2048, I 768, 128 experts, top 8):
  TFLOP/s; target >= 50 % of a dense bf16 GEMM of the same FLOPs
* FP8 W8A8 block-scaled GEMM: against ``torch._scaled_mm`` (row-wise scales);
  target within 20 %; FP8 weight-only GEMM: checked and timed against bf16
* decode step of a 1B-class random Llama, the engine with triton vs torch
  (greedy tokens equal in float32; ms per decode step in bfloat16)
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field


@dataclass
class Row:
    name: str
    ok: bool | None  # None: timing only
    err: str = ""
    ms: float | None = None
    figure: str = ""
    target: str = ""
    notes: list[str] = field(default_factory=list)


ROWS: list[Row] = []


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny shapes: checks the script's own logic")
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--skip-model", action="store_true", help="leave out the 1B-model decode step")
    return p.parse_args()


ARGS = parse()
if ARGS.dry_run:
    os.environ["TRITON_INTERPRET"] = "1"  # before any @triton.jit runs

import torch  # noqa: E402
from plinth.api import AttentionMetadata, QuantizedWeight, SelectionContext  # noqa: E402
from plinth_plugin_torch import attention as ref_attn  # noqa: E402
from plinth_plugin_torch import ops as ref_ops  # noqa: E402
from plinth_plugin_triton import fp8, moe, norm  # noqa: E402
from plinth_plugin_triton.attention import build_plan, paged_attention  # noqa: E402

#: the torch backend's attention backend: the reference the kernels are compared with
REF_ATTENTION = ref_attn.TorchAttention(SelectionContext())

DEV = torch.device("cpu" if ARGS.dry_run else "cuda")
DRY = ARGS.dry_run


def sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def bench(fn, *, iters: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of fn() (synchronized)."""
    if DRY:
        iters, warmup = 1, 0
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


def compare(got: torch.Tensor, want: torch.Tensor, tol: float) -> tuple[bool, str]:
    got, want = got.float(), want.float()
    if got.shape != want.shape:
        return False, f"shape {tuple(got.shape)} vs {tuple(want.shape)}"
    err = (got - want).abs()
    ok = bool(torch.isfinite(got).all()) and bool((err <= tol + tol * want.abs()).all())
    return ok, f"max abs {float(err.max()):.2e}"


def guarded(name: str):
    """A failing case becomes a failed row, never a crash of the whole table."""

    def deco(fn):
        def run(*a, **kw):
            try:
                fn(*a, **kw)
            except Exception as exc:  # noqa: BLE001
                ROWS.append(Row(name, False, f"{type(exc).__name__}: {str(exc)[:150]}"))
            finally:
                gc.collect()
                if DEV.type == "cuda":
                    torch.cuda.empty_cache()

        return run

    return deco


# ---- copy bandwidth ---------------------------------------------------------------------


def copy_bandwidth() -> float:
    n = (1 << 20) if DRY else (1 << 30)
    src = torch.ones(n, dtype=torch.uint8, device=DEV)  # touched: never the zero page
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    gbs = 2 * n / ms / 1e6
    ROWS.append(Row("copy bandwidth (1 GiB copy_)", None, ms=ms, figure=f"{gbs:.0f} GB/s"))
    return gbs


# ---- attention -------------------------------------------------------------------------------


def attention_meta(seqs: list[tuple[int, int]], page_size: int, num_pages: int, gen: torch.Generator) -> AttentionMetadata:
    """(cached, new) per sequence; pages shuffled over the pool."""
    need = [-(-(c + n) // page_size) for c, n in seqs]
    perm = torch.randperm(num_pages, generator=gen)[: sum(need)]
    tables, at = [], 0
    for k in need:
        tables.append(perm[at : at + k])
        at += k
    width = max(need)
    bt = torch.zeros(len(seqs), width, dtype=torch.int32)
    positions, slots, qsl = [], [], [0]
    for i, ((c, n), t) in enumerate(zip(seqs, tables)):
        bt[i, : len(t)] = t.to(torch.int32)
        pos = torch.arange(c, c + n)
        positions.append(pos)
        slots.append(t[pos // page_size].long() * page_size + pos % page_size)
        qsl.append(qsl[-1] + n)
    seq_lens = [c + n for c, n in seqs]
    return AttentionMetadata(
        positions=torch.cat(positions).to(DEV), slot_mapping=torch.cat(slots).to(DEV),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEV),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEV), block_tables=bt.to(DEV),
        page_size=page_size, max_query_len=max(n for _, n in seqs), max_seq_len=max(seq_lens),
        query_lens_cpu=[n for _, n in seqs], seq_lens_cpu=seq_lens,
    )


@guarded("decode attention")
def decode_attention(copy_gbs: float) -> None:
    gen = torch.Generator().manual_seed(0)
    batch, ctx, hq, hkv, d, page = (4, 100, 8, 2, 64, 16) if DRY else (64, 4096, 32, 8, 128, 16)
    dtype = torch.bfloat16
    num_pages = batch * -(-ctx // page) + 8
    k_pages, v_pages = REF_ATTENTION.allocate(num_pages=num_pages, page_size=page, num_kv_heads=hkv, head_dim=d, v_head_dim=d, dtype=dtype, device=DEV)
    k_pages.normal_()
    v_pages.normal_()
    meta = attention_meta([(ctx - 1, 1)] * batch, page, num_pages, gen)
    q = torch.randn(batch, hq, d, device=DEV, dtype=dtype)
    plan = build_plan(meta)
    got = paged_attention(q, k_pages, v_pages, meta, plan, scale=d**-0.5)
    meta.plan = REF_ATTENTION.build_plan(meta)
    k_new = ref_attn.token_major(k_pages).reshape(-1, hkv, d).index_select(0, meta.slot_mapping)
    v_new = ref_attn.token_major(v_pages).reshape(-1, hkv, d).index_select(0, meta.slot_mapping)
    want = REF_ATTENTION.forward(q, k_new, v_new, (k_pages, v_pages), meta, scale=d**-0.5)  # rewrites the same values
    ok, err = compare(got, want, 2e-2)
    ms = bench(lambda: paged_attention(q, k_pages, v_pages, meta, plan, scale=d**-0.5))
    ms_ref = bench(lambda: REF_ATTENTION.forward(q, k_new, v_new, (k_pages, v_pages), meta, scale=d**-0.5), iters=5)
    kv_bytes = 2 * batch * ctx * hkv * d * k_pages.element_size()
    gbs = kv_bytes / ms / 1e6
    ROWS.append(Row(f"decode attention B{batch} ctx{ctx} {hq}/{hkv}x{d} page{page}", ok, err, ms,
                    f"{gbs:.0f} GB/s = {100 * gbs / copy_gbs:.0f}% of copy; torch {ms_ref:.2f} ms", ">= 80% of copy"))


@guarded("prefill attention")
def prefill_attention() -> None:
    gen = torch.Generator().manual_seed(1)
    hq, hkv, d, page = (8, 2, 64, 7) if DRY else (32, 8, 128, 16)
    seqs = [(0, 37), (20, 9), (5, 1), (0, 0)] if DRY else [(0, 2048), (1024, 1024), (3000, 512), (100, 1), (0, 0)]
    dtype = torch.bfloat16
    num_pages = sum(-(-(c + n) // page) for c, n in seqs) + 8
    k_pages, v_pages = REF_ATTENTION.allocate(num_pages=num_pages, page_size=page, num_kv_heads=hkv, head_dim=d, v_head_dim=d, dtype=dtype, device=DEV)
    k_pages.normal_()
    v_pages.normal_()
    meta = attention_meta(seqs, page, num_pages, gen)
    t = sum(n for _, n in seqs)
    q = torch.randn(t, hq, d, device=DEV, dtype=dtype)
    k_new = ref_attn.token_major(k_pages).reshape(-1, hkv, d).index_select(0, meta.slot_mapping)
    v_new = ref_attn.token_major(v_pages).reshape(-1, hkv, d).index_select(0, meta.slot_mapping)
    plan = build_plan(meta)
    got = paged_attention(q, k_pages, v_pages, meta, plan, scale=d**-0.5)
    meta.plan = REF_ATTENTION.build_plan(meta)
    want = REF_ATTENTION.forward(q, k_new, v_new, (k_pages, v_pages), meta, scale=d**-0.5)
    ok, err = compare(got, want, 2e-2)
    ms = bench(lambda: paged_attention(q, k_pages, v_pages, meta, plan, scale=d**-0.5))
    flops = sum(4 * n * (c + (n + 1) / 2) * hq * d for c, n in seqs)
    ROWS.append(Row(f"prefill attention ragged {seqs}"[:60], ok, err, ms, f"{flops / ms / 1e9:.1f} TFLOP/s"))


# ---- rms_norm ---------------------------------------------------------------------------------


@guarded("rms_norm")
def rms_norm_case(copy_gbs: float) -> None:
    rows, h = (9, 96) if DRY else (8192, 4096)
    x = torch.randn(rows, h, device=DEV, dtype=torch.bfloat16)
    r = torch.randn_like(x)
    w = torch.randn(h, device=DEV, dtype=torch.bfloat16)
    y, s = norm.rms_norm(x, w, 1e-6, r)
    y_ref, s_ref = ref_ops.rms_norm(x, w, 1e-6, r)
    ok1, err1 = compare(y, y_ref, 2e-2)
    ok2, err2 = compare(s, s_ref, 2e-2)
    ms = bench(lambda: norm.rms_norm(x, w, 1e-6, r))
    ms_ref = bench(lambda: ref_ops.rms_norm(x, w, 1e-6, r))
    gbs = 4 * x.numel() * x.element_size() / ms / 1e6
    ROWS.append(Row(f"rms_norm+residual {rows}x{h}", ok1 and ok2, f"{err1}; sum {err2}", ms,
                    f"{gbs:.0f} GB/s = {100 * gbs / copy_gbs:.0f}% of copy; torch {ms_ref:.3f} ms"))


# ---- fused MoE -----------------------------------------------------------------------------------


def dense_tflops(m: int, k: int, n: int) -> float:
    a = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=DEV, dtype=torch.bfloat16)
    ms = bench(lambda: a @ b)
    return 2 * m * k * n / ms / 1e9


@guarded("fused MoE")
def fused_moe_case() -> None:
    tokens_list = [16, 40] if DRY else [64, 4096]
    e, h, inter, top_k = (16, 64, 48, 4) if DRY else (128, 2048, 768, 8)
    w13 = torch.randn(e, 2 * inter, h, device=DEV, dtype=torch.bfloat16) / math.sqrt(h)
    w2 = torch.randn(e, h, inter, device=DEV, dtype=torch.bfloat16) / math.sqrt(inter)
    for tokens in tokens_list:
        x = torch.randn(tokens, h, device=DEV, dtype=torch.bfloat16)
        logits = torch.randn(tokens, e, device=DEV)
        weights, ids = torch.topk(logits.softmax(-1), top_k)
        weights = weights.to(torch.bfloat16)
        got = moe.fused_moe(x, w13, w2, weights, ids)
        want = ref_ops.fused_moe(x, w13, w2, weights, ids)
        ok, err = compare(got, want, 3e-2)
        ms = bench(lambda x=x, weights=weights, ids=ids: moe.fused_moe(x, w13, w2, weights, ids))
        ms_ref = bench(lambda x=x, weights=weights, ids=ids: ref_ops.fused_moe(x, w13, w2, weights, ids), iters=5)
        flops = tokens * top_k * 6 * h * inter
        tf = flops / ms / 1e9
        dense = dense_tflops(tokens * top_k, h, 2 * inter)
        ROWS.append(Row(f"fused MoE T{tokens} E{e} top{top_k} H{h} I{inter}", ok, err, ms,
                        f"{tf:.1f} TFLOP/s = {100 * tf / dense:.0f}% of dense bf16 {dense:.0f}; torch {ms_ref:.2f} ms",
                        ">= 50% of dense" if tokens >= 1024 else ""))


# ---- FP8 -----------------------------------------------------------------------------------------


def scaled_mm_rowwise(aq: torch.Tensor, a_scale: torch.Tensor, bq: torch.Tensor, b_scale: torch.Tensor) -> torch.Tensor:
    return torch._scaled_mm(aq, bq.t(), scale_a=a_scale, scale_b=b_scale, out_dtype=torch.bfloat16)


@guarded("FP8 GEMMs")
def fp8_case() -> None:
    shapes = [(5, 256, 384), (33, 256, 384)] if DRY else [(16, 4096, 4096), (4096, 4096, 4096), (4096, 6144, 2048)]
    for m, n, k in shapes:
        w = torch.randn(n, k, device=DEV) / math.sqrt(k)
        q, s = fp8.quantize_block(w)
        qw = QuantizedWeight(format="fp8_e4m3", qweight=q, scale=s, shape=(n, k), block_size=(128, 128))
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        w8 = fp8.pack(qw, native=True)
        got = fp8.linear(x, w8)
        aq, a_s = fp8.act_quant(x)
        emulated = (aq.float() * a_s.repeat_interleave(128, 1)[:, :k]) @ ref_ops.dequantize_weight(qw, torch.float32).T
        ok, err = compare(got, emulated, 2e-2)
        ms = bench(lambda x=x, w8=w8: fp8.linear(x, w8))
        tf = 2 * m * n * k / ms / 1e9
        note = ""
        if DEV.type == "cuda":
            # the peer: torch._scaled_mm with row-wise scales (one per token, one per output channel)
            a_row = x.float().abs().amax(1, keepdim=True).clamp(min=1e-12) / 448
            b_row = w.abs().amax(1, keepdim=True).clamp(min=1e-12).t().contiguous() / 448
            a8 = (x.float() / a_row).to(torch.float8_e4m3fn)
            b8 = (w / b_row.t()).to(torch.float8_e4m3fn)
            ms_peer = bench(lambda a8=a8, a_row=a_row, b8=b8, b_row=b_row: scaled_mm_rowwise(a8, a_row, b8, b_row))
            note = f"; _scaled_mm {ms_peer:.3f} ms: {100 * ms_peer / ms:.0f}% of its speed"
        ROWS.append(Row(f"FP8 W8A8 block {m}x{n}x{k}", ok, err, ms, f"{tf:.0f} TFLOP/s{note}", "within 20% of _scaled_mm" if m >= 1024 else ""))
        wo = fp8.pack(qw, native=False)
        got = fp8.linear(x, wo)
        want = ref_ops.linear(x, qw)
        ok, err = compare(got, want, 3e-2)
        ms = bench(lambda x=x, wo=wo: fp8.linear(x, wo))
        wd = ref_ops.dequantize_weight(qw, torch.bfloat16)
        ms_bf16 = bench(lambda x=x, wd=wd: x @ wd.T)
        ROWS.append(Row(f"FP8 weight-only {m}x{n}x{k}", ok, err, ms, f"bf16 GEMM {ms_bf16:.3f} ms"))


# ---- a 1B-class model through the engine ------------------------------------------------------------


def random_model_dir(root: str) -> str:
    import transformers
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
    from tiny_models import tiny_model_dir, write_tokenizer

    if DRY:
        return tiny_model_dir("qwen3", root)
    cfg = transformers.LlamaConfig(  # Llama-3.2-1B's shapes, a 32k vocabulary
        vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_theta=500000.0, bos_token_id=None, eos_token_id=None,
    )
    path = os.path.join(root, "llama-1b-random")
    torch.manual_seed(0)
    with torch.device(DEV):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path)
    del model
    return path


@guarded("1B decode step")
def model_case() -> None:
    from plinth import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as root:
        path = random_model_dir(root)
        batch, prompt_len, new = (3, 20, 6) if DRY else (32, 256, 64)
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 256, (prompt_len,), generator=gen).tolist() for _ in range(batch)]
        tokens, step_ms = {}, {}
        for backend in ("torch", "triton"):
            # float32: the greedy tokens must agree; bfloat16: the timed run
            for dtype in ("float32", "bfloat16"):
                llm = LLM(path, device=DEV.type, backend=backend, dtype=dtype, page_size=16, num_pages=(64 if DRY else 4096), load_progress=False)
                if dtype == "float32":
                    outs = llm.generate(prompts[:4], SamplingParams(max_tokens=8 if not DRY else 4, temperature=0, ignore_eos=True))
                    tokens[backend] = [o.outputs[0].token_ids for o in outs]
                else:
                    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
                    many = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
                    llm.generate(prompts, one)  # warm up
                    t0 = time.perf_counter()
                    llm.generate(prompts, one)
                    sync()
                    t1 = time.perf_counter()
                    llm.generate(prompts, many)
                    sync()
                    t2 = time.perf_counter()
                    step_ms[backend] = ((t2 - t1) - (t1 - t0)) / (new - 1) * 1e3
                llm.close()
                del llm
                gc.collect()
        ok = tokens["torch"] == tokens["triton"]
        ROWS.append(Row(f"1B-class decode step B{batch} ctx~{prompt_len + new}", ok,
                        "greedy float32 tokens equal" if ok else f"tokens differ: {tokens}"[:150],
                        step_ms["triton"], f"torch {step_ms['torch']:.2f} ms/step: triton {step_ms['torch'] / step_ms['triton']:.2f}x"))


# ---- main --------------------------------------------------------------------------------------------


def main() -> int:
    t0 = time.time()
    if DEV.type == "cuda":
        name = torch.cuda.get_device_name(0)
        cap = torch.cuda.get_device_capability(0)
        print(f"device: {name} sm_{cap[0]}{cap[1]}, torch {torch.__version__}")
        if cap < (9, 0):
            print("note: W8A8 FP8 needs sm_90; its rows will fail here")
    else:
        print("dry run: CPU, TRITON_INTERPRET=1, tiny shapes (timings are the interpreter's, not figures)")
    copy_gbs = copy_bandwidth()
    decode_attention(copy_gbs)
    prefill_attention()
    rms_norm_case(copy_gbs)
    fused_moe_case()
    fp8_case()
    if not ARGS.skip_model:
        model_case()
    width = max(len(r.name) for r in ROWS)
    print(f"\n{'kernel'.ljust(width)}  check  {'error':<22} {'ms':>9}  figure [target]")
    for r in ROWS:
        check = "-" if r.ok is None else ("ok" if r.ok else "FAIL")
        ms = f"{r.ms:9.3f}" if r.ms is not None else " " * 9
        target = f" [{r.target}]" if r.target else ""
        print(f"{r.name.ljust(width)}  {check:<5}  {r.err:<22} {ms}  {r.figure}{target}")
    failed = [r.name for r in ROWS if r.ok is False]
    print(f"\n{len(ROWS)} rows, {len(failed)} failed, {time.time() - t0:.0f} s")
    if ARGS.json:
        with open(ARGS.json, "w") as f:
            json.dump([r.__dict__ for r in ROWS], f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
