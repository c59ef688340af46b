"""Batch invariance (``--deterministic``): a row's result must be bit for bit
the same whatever other rows share the call, however many, and wherever the
row sits among them; and one sequence's attention rows must be the same
however a server computes them (decode, prefill, chunks, verification, among
other sequences).

``batch_invariance_problems(fn, rows)`` runs ``fn`` on one probe row alone
and then inside batches of other rows of the pool at several sizes and
positions, and lists every batch where the probe's output is not
``torch.equal`` to the lone result. ``fn`` takes the row-aligned tensors of a
batch (each [M, ...]) and returns a tensor or a tuple of tensors [M, ...].

``rowwise_invariance_problems(ops, op, dtype)`` does it for each of ``ROWWISE_OPS``
(rms_norm, silu_and_mul, rotary) on seeded rows.

``attention_invariance_problems(ops, dtype, device)`` computes one sequence's
attention every way below, at every page size given:

* ``decode``: one token per step, from position 0;
* ``prefill``: the whole prompt as one chunk (cold, unchunked);
* ``chunks a+b+...``: the prompt in chunks, each later chunk reading the
  earlier K/V back from the pages (what a prefix-cache hit does too);
* ``verify``: decode to a point, then steps of k + 1 rows (a speculative
  verification), then decode again;
* ``among others``: the same chunks inside steps that carry other sequences
  (prefill chunks and decodes) before and after it.

The sequence's q/k/v (or fused qkv) per position are fixed by a seed, so every
way sees the same inputs; any output of a position that differs from the
``decode`` way's is a problem. Both are used by the backends' tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from plinth.testing.backend import attention_metadata

#: the batch sizes a probe row is put among (1: the lone row itself, called again)
BATCH_SIZES = (1, 2, 3, 7, 16, 17, 33, 64)


def _outputs(result: Any) -> tuple[Any, ...]:
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def batch_invariance_problems(
    fn: Callable[..., Any],
    rows: Sequence[Any],
    *,
    probes: Sequence[int] = (0, 5),
    sizes: Sequence[int] = BATCH_SIZES,
) -> list[str]:
    """Every (probe, batch size, position) whose outputs differ from the
    probe row computed alone; empty when ``fn`` is batch-invariant on these
    rows. ``rows``: row-aligned tensors [P, ...], P >= max(sizes)."""
    import torch

    pool = rows[0].shape[0]
    if pool < max(sizes):
        raise ValueError(f"a pool of {pool} rows cannot fill batches of {max(sizes)}")
    problems = []
    for probe in probes:
        alone = _outputs(fn(*(t[probe : probe + 1].clone() for t in rows)))
        others = [i for i in range(pool) if i != probe]
        for size in sizes:
            for position in sorted({0, size // 2, size - 1}):
                # other rows around it, a different selection per size
                fill = others[size % len(others) :] + others[: size % len(others)]
                index = fill[:position] + [probe] + fill[position : size - 1]
                got = _outputs(fn(*(t[index].clone() for t in rows)))
                for k, (a, b) in enumerate(zip(alone, got)):
                    if not torch.equal(a[0], b[position]):
                        diff = (a[0].float() - b[position].float()).abs().max().item()
                        problems.append(f"output {k} of row {probe} at position {position} of {size}: max abs diff {diff:.3g}")
    return problems



#: the row-wise ops every backend's deterministic table must keep batch-invariant
ROWWISE_OPS = ("rms_norm", "rms_norm_residual", "rms_norm_qk_heads", "silu_and_mul", "rotary_neox", "rotary_gptj", "rotary_qk_heads")


def rowwise_invariance_problems(ops: Any, op: str, dtype: Any, *, hidden: int = 576, pool: int = 64) -> list[str]:
    """``batch_invariance_problems`` for one of ``ROWWISE_OPS`` of an op
    table (``ops.rms_norm`` and so on), on seeded random rows of ``dtype``:
    rms_norm over ``hidden`` (with and without the fused residual; and per
    head on q split from a fused qkv row, a view strided only for more than
    one token), silu_and_mul over 2 x 1536, rotary on 9 query and 3 key
    heads of 64 (separate tensors, and views of a fused qkv row)."""
    import torch

    gen = torch.Generator().manual_seed(ROWWISE_OPS.index(op))

    def randn(*shape: int) -> Any:
        return torch.randn(*shape, generator=gen).to(dtype)

    if op in ("rms_norm", "rms_norm_residual"):
        weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
        if op == "rms_norm":
            return batch_invariance_problems(lambda x: ops.rms_norm(x, weight, 1e-5), [randn(pool, hidden)])
        return batch_invariance_problems(lambda x, r: ops.rms_norm(x, weight, 1e-5, r), [randn(pool, hidden), randn(pool, hidden)])
    if op == "rms_norm_qk_heads":
        # Qwen3's q norm: per head, on q split from a fused qkv row (a view that is
        # contiguous for one token and strided for more)
        weight = (1 + 0.1 * torch.randn(64, generator=gen)).to(dtype)
        return batch_invariance_problems(
            lambda qkv: ops.rms_norm(qkv[:, : 4 * 64].view(-1, 4, 64), weight, 1e-6), [randn(pool, (4 + 2 * 2) * 64)]
        )
    if op == "silu_and_mul":
        return batch_invariance_problems(ops.silu_and_mul, [randn(pool, 2 * 1536)])
    if op in ("rotary_neox", "rotary_gptj", "rotary_qk_heads"):
        d = 64
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
        angles = torch.arange(256).float()[:, None] * inv[None]
        cos_sin = torch.cat((angles.cos(), angles.sin()), -1)
        is_neox = op != "rotary_gptj"
        positions = torch.randint(0, 256, (pool,), generator=gen)
        if op == "rotary_qk_heads":  # q and k split from a fused qkv row, as models call it
            return batch_invariance_problems(
                lambda qkv, p: ops.rotary(qkv[:, : 9 * d].view(-1, 9, d), qkv[:, 9 * d : 12 * d].view(-1, 3, d), p, cos_sin, is_neox),
                [randn(pool, 15 * d), positions],
            )
        return batch_invariance_problems(
            lambda q, k, p: ops.rotary(q, k, p, cos_sin, is_neox), [randn(pool, 9, d), randn(pool, 3, d), positions]
        )
    raise ValueError(f"{op!r} is not one of {ROWWISE_OPS}")



@dataclass
class InvarianceCase:
    """The sequence under test and the shapes."""

    length: int = 75  # crosses blocks of 8, 16 and 32 keys
    heads: tuple[int, int] = (9, 3)  # SmolLM2's grouped-query shape
    head_dim: int = 64
    window: int | None = None
    fused: bool = False  # the attention backend's qkv_fusion() (rotary inside) instead of forward
    seed: int = 0


def _ways(length: int) -> dict[str, list[list[int]]]:
    """way -> steps, each step the sequence's chunk sizes (one chunk per step)."""
    third = length // 3
    mid = min(32, length - 6)  # a 32-token chunk where the sequence is long enough
    lead = min(30, length // 2)  # decoded tokens before the verification steps
    return {
        "decode": [[1]] * length,
        "prefill": [[length]],
        f"chunks {third}+{length - third}": [[third], [length - third]],
        f"chunks 5+{mid}+rest": [[5], [mid], [length - 5 - mid]],
        "chunks 17 then decode": [[17]] + [[1]] * (length - 17),
        "verify k=4": [[1]] * lead + [[5]] * ((length - lead) // 5) + [[1]] * ((length - lead) % 5),
    }


def attention_invariance_problems(
    attention: Any, dtype: Any, device: Any, *, page_sizes: tuple[int, ...] = (16, 7), case: InvarianceCase | None = None
) -> list[str]:
    """Every position whose output differs between two ways of computing it
    (empty: invariant). ``attention``: an attention backend
    (``plinth.testing.attention_backend``)."""
    import torch

    case = case or InvarianceCase()
    num_heads, num_kv = case.heads
    dim, length = case.head_dim, case.length
    g = torch.Generator().manual_seed(case.seed)
    width = (num_heads + 2 * num_kv) * dim
    data = torch.randn(length, width, generator=g).to(dtype)  # the sequence's q|k|v per position
    others = torch.randn(4096, width, generator=g).to(dtype)  # the other sequences' rows
    cos_sin = torch.cat([torch.rand(length + 64, dim // 2, generator=g) * 6.28] * 2, dim=1)
    cos_sin[:, : dim // 2].cos_()
    cos_sin[:, dim // 2 :].sin_()
    cos_sin = cos_sin.to(device)
    scale = dim**-0.5

    def run(steps: list[list[int]], page_size: int, crowd: bool) -> torch.Tensor:
        """The sequence's output rows [length, Hq * Dv], computed in these steps."""
        # room for the other sequences' tokens too (at most 23 a step before, 1 after)
        per_seq = -(-max(length, 1200, 23 * len(steps)) // page_size)
        num_pages = 3 * per_seq
        cache = attention.allocate(
            num_pages=num_pages, page_size=page_size, num_kv_heads=num_kv, head_dim=dim, v_head_dim=dim, dtype=dtype, device=device,
        )
        order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(page_size)).tolist()
        tables = [order[0:per_seq], order[per_seq : 2 * per_seq], order[2 * per_seq : 3 * per_seq]]
        out = torch.empty(length, num_heads * dim, dtype=dtype)
        done, other_done, cursor = 0, [0, 0], 0
        for i, (n,) in enumerate(steps):
            seqs, rows = [], []
            if crowd:  # another sequence before (a prefill chunk or a decode) and one after (decoding)
                before = 1 + (i * 7) % 23 if i % 2 == 0 else 1
                seqs.append((other_done[0], before))
                rows.append(others[cursor : cursor + before])
                cursor, other_done[0] = cursor + before, other_done[0] + before
            seqs.append((done, n))
            rows.append(data[done : done + n])
            if crowd:
                seqs.append((other_done[1], 1))
                rows.append(others[cursor : cursor + 1])
                cursor, other_done[1] = cursor + 1, other_done[1] + 1
            seq_tables = [tables[1], tables[0], tables[2]] if crowd else [tables[0]]
            meta = attention_metadata(seqs, seq_tables, page_size, device)
            meta.plan = attention.build_plan(meta)
            x = torch.cat(rows).to(device)
            t = x.shape[0]
            if case.fused:
                y = attention.qkv_fusion()(
                    x, meta.positions, cos_sin, True, cache, meta, num_heads=num_heads, num_kv_heads=num_kv,
                    head_dim=dim, scale=scale, sliding_window=case.window,
                )
            else:
                q, k, v = x.split((num_heads * dim, num_kv * dim, num_kv * dim), dim=-1)
                y = attention.forward(
                    q.reshape(t, num_heads, dim), k.reshape(t, num_kv, dim), v.reshape(t, num_kv, dim), cache, meta,
                    scale=scale, sliding_window=case.window,
                )
            first = seqs[0][1] if crowd else 0
            out[done : done + n] = y.reshape(t, -1)[first : first + n].cpu()
            done += n
        return out

    results: dict[str, torch.Tensor] = {}
    for page_size in page_sizes:
        for name, steps in _ways(length).items():
            results[f"{name}, page size {page_size}"] = run(steps, page_size, crowd=False)
        results[f"chunks among others, page size {page_size}"] = run(_ways(length)[f"chunks {length // 3}+{length - length // 3}"], page_size, crowd=True)
        results[f"decode among others, page size {page_size}"] = run(_ways(length)["decode"], page_size, crowd=True)
    base_name = f"decode, page size {page_sizes[0]}"
    base = results[base_name]
    problems = []
    for name, got in results.items():
        differ = [p for p in range(length) if not torch.equal(got[p], base[p])]
        if differ:
            worst = float((got.float() - base.float()).abs().max())
            problems.append(f"{name}: {len(differ)} of {length} positions differ from '{base_name}' (first {differ[:5]}, max abs diff {worst:.3g})")
    return problems
