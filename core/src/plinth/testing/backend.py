"""Backend conformance: a backend's ops against the reference backend's, on
random inputs, through the same op-table merge the engine uses; its attention
backend against the reference's.

Attention is checked against what the attention backend declares: its pages
have the shape its ``layout`` gives (a page is one index of the page
dimension), ``problems`` answers with reasons (and names a page size its
``page_sizes`` exclude), and at the page sizes it takes both attention
backends allocate their own pages, run the same steps (a prefill that writes
K/V, a chunk after a cached prefix, a mixed step, decode steps, a page copy
for a fork) and must give the same outputs.
"""

from __future__ import annotations

from typing import Any

from plinth.testing._report import Report
from plinth.testing.registration import discover_all

#: tolerance (atol = rtol) per dtype name
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 3e-3}


def _close(report: Report, what: str, got: Any, want: Any, tol: float) -> None:
    import torch

    got, want = got.float(), want.float()
    if got.shape != want.shape:
        report.problem(f"{what}: shape {tuple(got.shape)}, the reference gives {tuple(want.shape)}")
        return
    err = (got - want).abs()
    bound = tol + tol * want.abs()
    worst = float((err - bound).max()) if err.numel() else 0.0
    report.expect(worst <= 0 and bool(torch.isfinite(got).all()), what, f"max abs diff {float(err.max()):.3g} (tolerance {tol})")


def resolve_op_table(backend: str, ctx: Any) -> tuple[Any, dict[str, str]]:
    """(the op table, op -> the backend it came from) that start-up builds
    for ``--backend backend`` in ``ctx``, through the real discovery
    (``"reference"``: the reference backend alone)."""
    from plinth.engine.startup import resolve_ops

    registry = discover_all()
    if backend == "reference":
        entry = next((e for e in registry.entries["backend"] if getattr(e.descriptor, "reference", False)), None)
        if entry is None:
            raise LookupError("no reference backend is installed")
    else:
        entry = registry.get("backend", backend)
    return resolve_ops(registry, entry, ctx)


def op_table(ctx: Any, backend: str = "reference") -> Any:
    """The op table of ``resolve_op_table``, without the sources."""
    return resolve_op_table(backend, ctx)[0]


def resolve_attention_backend(backend: str, ctx: Any, ops: Any = None) -> tuple[Any, str]:
    """(the attention backend, the backend it came from) that start-up builds
    for ``--backend backend`` in ``ctx`` over the op table ``ops`` (None: the
    one ``resolve_op_table`` gives), through the real discovery."""
    from plinth.engine.startup import resolve_attention

    registry = discover_all()
    if backend == "reference":
        entry = next((e for e in registry.entries["backend"] if getattr(e.descriptor, "reference", False)), None)
        if entry is None:
            raise LookupError("no reference backend is installed")
    else:
        entry = registry.get("backend", backend)
    if ops is None:
        from plinth.engine.startup import resolve_ops

        ops = resolve_ops(registry, entry, ctx)[0]
    return resolve_attention(registry, entry, ctx, ops)


def attention_backend(ctx: Any, backend: str = "reference", ops: Any = None) -> Any:
    """The attention backend of ``resolve_attention_backend``, without the source."""
    return resolve_attention_backend(backend, ctx, ops)[0]


def attention_metadata(seqs: list[tuple[int, int]], tables: list[list[int]], page_size: int, device: Any) -> Any:
    """AttentionMetadata for sequences given as (cached length, new tokens),
    sequence i's pages ``tables[i]``."""
    import torch

    from plinth.api import AttentionMetadata

    positions, slots, qsl = [], [], [0]
    for (cached, n), pages in zip(seqs, tables):
        for pos in range(cached, cached + n):
            positions.append(pos)
            slots.append(pages[pos // page_size] * page_size + pos % page_size)
        qsl.append(qsl[-1] + n)
    width = max(len(t) for t in tables)
    block = torch.zeros(len(seqs), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        block[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    seq_lens = [c + n for c, n in seqs]
    return AttentionMetadata(
        positions=torch.tensor(positions, device=device),
        slot_mapping=torch.tensor(slots, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block.to(device),
        page_size=page_size,
        max_query_len=max(n for _, n in seqs),
        max_seq_len=max(seq_lens),
        query_lens_cpu=[n for _, n in seqs],
        seq_lens_cpu=seq_lens,
    )


def random_attention_metadata(query_lens: list[int], seq_lens: list[int], page_size: int, generator: Any, *, spare_pages: int = 2, device: Any = "cpu") -> tuple[Any, int]:
    """(AttentionMetadata, the pool's page count) for sequences whose last
    ``query_lens[i]`` of ``seq_lens[i]`` positions are new, their pages drawn
    in random order (``generator``) from a pool with ``spare_pages`` unused."""
    import torch

    pages_per = [-(-s // page_size) for s in seq_lens]
    num_pages = sum(pages_per) + spare_pages
    order = torch.randperm(num_pages, generator=generator).tolist()
    tables = [[order.pop() for _ in range(n)] for n in pages_per]
    seqs = [(s - n, n) for n, s in zip(query_lens, seq_lens)]
    return attention_metadata(seqs, tables, page_size, torch.device(device)), num_pages


def _check_attention(report: Report, mine: Any, ref: Any, dtype: Any, device: Any, tol: float, *, page_size: int, heads: tuple[int, int], window: int | None) -> None:
    """``mine`` and ``ref``: attention backends."""
    import torch

    g = torch.Generator().manual_seed(page_size * 31 + heads[0])
    num_heads, num_kv = heads
    dim, num_pages = 32, 64
    label = f"attention ({dtype}, page size {page_size}, {num_heads}/{num_kv} heads, window {window})"
    caches = [
        attn.allocate(num_pages=num_pages, page_size=page_size, num_kv_heads=num_kv, head_dim=dim, v_head_dim=dim, dtype=dtype, device=device)
        for attn in (mine, ref)
    ]
    want = mine.layout.shape(num_pages=num_pages, page_size=page_size, num_kv_heads=num_kv, head_dim=dim)
    report.expect(
        all(t is not None and tuple(t.shape) == want for t in caches[0]),
        f"{label}: allocate() gives pages of the shape its layout {mine.layout.dims} declares", f"{[tuple(t.shape) if t is not None else None for t in caches[0]]}, want {want}",
    )
    pages = torch.randperm(num_pages, generator=g).tolist()
    tables = [pages[0:12], pages[12:24], pages[24:36]]  # one more table for the fork below
    steps = [
        [(0, 20), (0, 5)],  # prefill from position 0
        [(20, 9), (5, 1)],  # a chunk after a cached prefix, with a decode
        [(29, 1), (6, 1)],  # decode only
        [(30, 1), (7, 1)],
    ]
    for i, seqs in enumerate(steps):
        t = sum(n for _, n in seqs)
        q = torch.randn(t, num_heads, dim, generator=g).to(dtype).to(device)
        k = torch.randn(t, num_kv, dim, generator=g).to(dtype).to(device)
        v = torch.randn(t, num_kv, dim, generator=g).to(dtype).to(device)
        outs = []
        for attn, cache in zip((mine, ref), caches):
            meta = attention_metadata(seqs, tables[: len(seqs)], page_size, device)
            meta.plan = attn.build_plan(meta)
            outs.append(attn.forward(q, k, v, cache, meta, scale=dim**-0.5, sliding_window=window))
        _close(report, f"{label}, step {i + 1} {seqs}", outs[0], outs[1], tol)
    # fork sequence 0 into table 2 (copy its pages) and decode both
    n_pages = -(-31 // page_size)
    for attn, cache in zip((mine, ref), caches):
        attn.copy_pages([cache], torch.tensor(tables[0][:n_pages]), torch.tensor(tables[2][:n_pages]))
    seqs = [(31, 1), (31, 1)]  # the same new token in parent and fork
    q = torch.randn(1, num_heads, dim, generator=g).repeat(2, 1, 1).to(dtype).to(device)
    k = torch.randn(1, num_kv, dim, generator=g).repeat(2, 1, 1).to(dtype).to(device)
    v = torch.randn(1, num_kv, dim, generator=g).repeat(2, 1, 1).to(dtype).to(device)
    outs = []
    for attn, cache in zip((mine, ref), caches):
        meta = attention_metadata(seqs, [tables[0], tables[2]], page_size, device)
        meta.plan = attn.build_plan(meta)
        outs.append(attn.forward(q, k, v, cache, meta, scale=dim**-0.5, sliding_window=window))
    _close(report, f"{label}, after copy_pages (a fork decodes like its parent)", outs[0][1], outs[0][0], tol)
    _close(report, f"{label}, forked decode against the reference", outs[0], outs[1], tol)


def _check_qkv_attention(report: Report, mine: Any, ref: Any, ref_ops: Any, dtype: Any, device: Any, tol: float, *, page_size: int, heads: tuple[int, int]) -> None:
    """The fused block (``mine.qkv_fusion()``) against the reference's rotary
    then attention, over the same steps as ``_check_attention`` (prefill,
    prefix chunk + decode, decodes)."""
    import torch

    g = torch.Generator().manual_seed(page_size * 37 + heads[0])
    num_heads, num_kv = heads
    dim, num_pages = 32, 64
    label = f"qkv_fusion ({dtype}, page size {page_size}, {num_heads}/{num_kv} heads)"
    fused = mine.qkv_fusion()
    caches = [
        attn.allocate(num_pages=num_pages, page_size=page_size, num_kv_heads=num_kv, head_dim=dim, v_head_dim=dim, dtype=dtype, device=device)
        for attn in (mine, ref)
    ]
    pages = torch.randperm(num_pages, generator=g).tolist()
    tables = [pages[0:12], pages[12:24]]
    cos_sin = torch.cat([torch.rand(64, dim // 2, generator=g) * 6.28] * 2, dim=1).to(device)
    cos_sin[:, : dim // 2].cos_()
    cos_sin[:, dim // 2 :].sin_()
    kw = dict(num_heads=num_heads, num_kv_heads=num_kv, head_dim=dim, scale=dim**-0.5, sliding_window=None)
    for i, seqs in enumerate([[(0, 20), (0, 5)], [(20, 9), (5, 1)], [(29, 1), (6, 1)], [(30, 1), (7, 1)]]):
        t = sum(n for _, n in seqs)
        qkv = torch.randn(t, (num_heads + 2 * num_kv) * dim, generator=g).to(dtype).to(device)
        outs = []
        for attn, cache in zip((mine, ref), caches):
            meta = attention_metadata(seqs, tables, page_size, device)
            meta.plan = attn.build_plan(meta)
            if attn is mine:
                outs.append(fused(qkv, meta.positions, cos_sin, True, cache, meta, **kw))
            else:
                q, k, v = qkv.split((num_heads * dim, num_kv * dim, num_kv * dim), dim=-1)
                q, k = ref_ops.rotary(q.reshape(t, num_heads, dim), k.reshape(t, num_kv, dim), meta.positions, cos_sin, True)
                out = ref.forward(q, k, v.reshape(t, num_kv, dim), cache, meta, scale=dim**-0.5)
                outs.append(out.reshape(t, -1))
        _close(report, f"{label}, step {i + 1} {seqs}", outs[0], outs[1], tol)


def check_backend(
    name: str,
    *,
    dtypes: tuple[str, ...] = ("float32", "bfloat16"),
    accelerator: str = "auto",
    require_available: bool = False,
    page_sizes: tuple[int, ...] | None = None,
    sliding_window: bool | None = None,
) -> Report:
    """Every op ``name`` provides, against the reference backend's, and its
    attention backend (when it brings one) against the reference's and its
    own declarations, on the chosen accelerator's device (``auto``: the best
    available).

    page_sizes: the page sizes attention is checked at (None: the first two
    of 16, 7, 32 and 128 its ``page_sizes`` take); sliding_window: whether to
    check a window (None: unless its ``problems`` decline a windowed model)."""
    import dataclasses

    import torch

    from plinth.api import SelectionContext
    from plinth.engine.startup import resolve_attention, resolve_ops

    report = Report(f"backend {name}")
    registry = discover_all()
    entry = registry.get("backend", name)
    acc_entry = registry.select("accelerator", accelerator, SelectionContext())
    acc = acc_entry.load()()
    device = acc.device(0)
    references = [e for e in registry.entries["backend"] if getattr(e.descriptor, "reference", False)]
    if not references:
        report.problem("no reference backend is installed to compare against")
        return report.raise_for_problems()
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        ctx = SelectionContext(accelerator=acc, dtype=dtype)
        reasons = entry.evaluate(ctx)
        if reasons:
            msg = f"{dtype_name} on {acc_entry.name}: unavailable: {'; '.join(reasons)}"
            report.problem(msg) if require_available else report.skip(msg)
            continue
        ops, sources = resolve_ops(registry, entry, ctx)
        ref, _ = resolve_ops(registry, references[0], ctx)
        attention, attention_source = resolve_attention(registry, entry, ctx, ops)
        ref_attention, _ = resolve_attention(registry, references[0], ctx, ref)
        mine = sorted(op for op, src in sources.items() if src == name)
        brings_attention = attention_source == name and entry is not references[0]
        report.ok(f"{dtype_name}: provides {', '.join(mine + (['attention'] if brings_attention else [])) or 'no op (the reference serves all)'}")
        _check_unsupported(report, entry.load(), ctx, set(mine), dtype_name)
        tol = TOLERANCE.get(dtype_name, 1e-2)
        _check_ops(report, ops, ref, set(mine), dtype, device, tol)
        sizes = _check_attention_declarations(report, type(attention), ctx, dtype_name)
        if not brings_attention:
            continue
        sizes = page_sizes or sizes
        if not sizes:
            report.problem(f"{dtype_name}: its attention backend takes none of the page sizes 16, 7, 32, 128")
            continue
        window = sliding_window
        if window is None:  # it must attend with a window or decline models that have one
            windowed = dataclasses.replace(ctx, model=_windowed_model())
            window = not type(attention).problems(windowed)
        for page_size in sizes:
            for heads in ((6, 2), (4, 4)):
                _check_attention(report, attention, ref_attention, dtype, device, tol, page_size=page_size, heads=heads, window=None)
        if window:
            _check_attention(report, attention, ref_attention, dtype, device, tol, page_size=sizes[-1], heads=(6, 2), window=9)
        else:
            report.ok(f"{dtype_name}: declines sliding-window models (its problems() say why)")
        if attention.qkv_fusion() is not None:
            for page_size in sizes:
                _check_qkv_attention(report, attention, ref_attention, ref, dtype, device, tol, page_size=page_size, heads=(6, 2))
    return report.raise_for_problems()


def _windowed_model() -> Any:
    from plinth.api import ModelConfig

    return ModelConfig(architecture="Windowed", vocab_size=64, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                       max_model_len=256, sliding_window=9)  # fmt: skip


def _check_attention_declarations(report: Report, cls: Any, ctx: Any, dtype_name: str) -> list[int]:
    """``problems`` returns reasons (strings) and names exactly the page sizes
    its ``page_sizes`` exclude; its ``layout`` orders the four page
    dimensions. Returns the first two of 16, 7, 32, 128 it takes."""
    import dataclasses

    from plinth.api import PAGE_DIMS

    label = f"{dtype_name}: attention backend {cls.__name__}"
    report.expect(sorted(cls.layout.dims) == sorted(PAGE_DIMS), f"{label}: its layout orders {', '.join(PAGE_DIMS)}", repr(cls.layout))
    takes = []
    for page_size in (16, 7, 32, 128, 1, 48):
        try:
            reasons = cls.problems(dataclasses.replace(ctx, page_size=page_size))
        except Exception as exc:
            report.problem(f"{label}: problems() at page size {page_size} raised {type(exc).__name__}: {exc}")
            return []
        if not (isinstance(reasons, list) and all(isinstance(r, str) and r for r in reasons)):
            report.problem(f"{label}: problems() returns a list of reasons (strings), not {reasons!r}")
            return []
        declared = cls.page_sizes.problem(page_size) is None
        named = any(f"page size {page_size}" in r for r in reasons)
        report.expect(declared != named, f"{label}: page size {page_size} {'taken' if declared else 'declined with its reason'}, as page_sizes says", "; ".join(reasons) or "no reason given")
        if declared and not reasons and page_size in (16, 7, 32, 128):
            takes.append(page_size)
    return takes[:2]


def _check_unsupported(report: Report, impl: Any, ctx: Any, mine: set[str], dtype_name: str) -> None:
    """unsupported_ops(ctx) is {op: reason} and names no op the backend then provides."""
    try:
        limits = dict(impl.unsupported_ops(ctx))
    except Exception as exc:
        report.problem(f"unsupported_ops() raised {type(exc).__name__}: {exc}")
        return
    report.expect(
        all(isinstance(op, str) and isinstance(why, str) and why for op, why in limits.items()),
        f"{dtype_name}: unsupported_ops() maps op names to reasons", repr(limits),
    )
    report.expect(
        not set(limits) & mine, f"{dtype_name}: no op it calls unsupported is taken from it",
        ", ".join(sorted(set(limits) & mine)),
    )
    if limits:
        report.ok(f"{dtype_name}: from the reference, with reasons: {', '.join(sorted(limits))}")


def _check_ops(report: Report, ops: Any, ref: Any, mine: set[str], dtype: Any, device: Any, tol: float) -> None:
    import torch

    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> Any:
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    if "rms_norm" in mine:
        x, w, r = rand(7, 96), rand(96), rand(7, 96)
        _close(report, f"rms_norm ({dtype})", ops.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), tol)
        y, res = ops.rms_norm(x, w, 1e-6, r)
        y_ref, res_ref = ref.rms_norm(x, w, 1e-6, r)
        _close(report, f"rms_norm with residual ({dtype})", y, y_ref, tol)
        _close(report, f"rms_norm residual sum ({dtype})", res, res_ref, tol)
    if "linear" in mine or "pack_linear" in mine:
        for rows in (1, 5, 64):
            w, b, x = rand(48, 40), rand(48), rand(rows, 40)
            _close(report, f"linear, {rows} rows ({dtype})", ops.linear(x, ops.pack_linear(w)), ref.linear(x, ref.pack_linear(w)), tol)
            _close(report, f"linear with bias, {rows} rows ({dtype})", ops.linear(x, ops.pack_linear(w), b), ref.linear(x, ref.pack_linear(w), b), tol)
    if "silu_and_mul" in mine:
        x = rand(9, 64)
        _close(report, f"silu_and_mul ({dtype})", ops.silu_and_mul(x), ref.silu_and_mul(x), tol)
    if "rotary" in mine:
        positions = torch.randint(0, 100, (6,), generator=g).to(device)
        cos_sin = torch.randn(128, 32, generator=g).to(device)
        for neox in (True, False):
            q, k = rand(6, 4, 32), rand(6, 2, 32)
            got = ops.rotary(q.clone(), k.clone(), positions, cos_sin, neox)
            want = ref.rotary(q.clone(), k.clone(), positions, cos_sin, neox)
            _close(report, f"rotary q (neox={neox}, {dtype})", got[0], want[0], tol)
            _close(report, f"rotary k (neox={neox}, {dtype})", got[1], want[1], tol)
    if "fused_moe" in mine:
        _check_fused_moe(report, ops, ref, rand, g, dtype, device, tol)


def _moe_loop(x: Any, w13: Any, w2: Any, weights: Any, ids: Any) -> Any:
    """fused_moe by its definition, one (token, expert) pair at a time, in float64."""
    import torch

    inter = w2.shape[2]
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if 0 <= e < w13.shape[0]:
                gu = w13[e].double().cpu() @ x[t].double().cpu()
                act = torch.nn.functional.silu(gu[:inter]) * gu[inter:]
                out[t] += float(weights[t, k]) * (w2[e].double().cpu() @ act)
    return out


def _check_fused_moe(report: Report, ops: Any, ref: Any, rand: Any, g: Any, dtype: Any, device: Any, tol: float) -> None:
    """Random routing over 8 experts (some get no tokens), ids of other ranks
    (-1 and >= E) skipped, a single token, no routed token at all: against
    the definition computed pair by pair, and against the reference op."""
    import torch

    num_experts, hidden, inter = 8, 32, 24
    w13, w2 = rand(num_experts, 2 * inter, hidden) / 4, rand(num_experts, hidden, inter) / 4
    for tokens, top_k in ((13, 2), (1, 3), (6, 1)):
        x = rand(tokens, hidden)
        logits = torch.randn(tokens, 5, generator=g)  # only experts 0..4 chosen: 5..7 get nothing
        weights, ids = torch.topk(logits.softmax(-1), top_k)
        ids = ids.clone()
        if tokens > 2:
            ids[0, 0], ids[1, -1] = -1, num_experts + 2  # other ranks' experts
        weights, ids = weights.to(dtype).to(device), ids.to(device)
        got = ops.fused_moe(x, w13, w2, weights, ids)
        label = f"fused_moe, {tokens} tokens, top {top_k} ({dtype})"
        _close(report, f"{label} against its definition", got, _moe_loop(x, w13, w2, weights, ids).to(got.dtype), tol)
        _close(report, f"{label} against the reference", got, ref.fused_moe(x, w13, w2, weights, ids), tol)
    x = rand(4, hidden)
    nothing = ops.fused_moe(x, w13, w2, torch.ones(4, 2, dtype=dtype, device=device), torch.full((4, 2), -1, device=device))
    report.expect(nothing.shape == x.shape and float(nothing.abs().max()) == 0, f"fused_moe with no routed token ({dtype})", "gives zeros")
