"""a2a conformance: dispatch then combine over real processes.

On every rank, random routing (some experts get no token, some ranks send
no token, all tokens to one rank's experts) goes through dispatch, experts
that multiply by a known factor (identity experts, and f_e(x) = (e + 1) x so
a token reaching the wrong expert shows), then combine; the result must be
sum_k w_k f_{e_k}(x) for every token, with 3 experts a rank and with one
expert more than the group divides (the first ranks own one more, as
``plinth.api.expert_ranges`` says). Both layouts (``decode=False`` and
``True``) are checked, in float32 and bfloat16, and a float8 dispatch must
deliver the bytes sent. The layout's bookkeeping is checked too: local ids
in range, per-expert counts equal to the pairs received.
"""

from __future__ import annotations

from typing import Any

from plinth.testing._report import Report


def _expected(x: Any, weights: Any, ids: Any, scaled: bool) -> Any:
    factor = (ids.float() + 1) if scaled else 1.0
    return x.float() * (weights.float() * factor).sum(-1, keepdim=True)


def _experts(got: Any, start: int, scaled: bool) -> Any:
    """The output of experts f_e(x) = x (or (e + 1) x) in got's layout."""
    import torch

    if got.layout == "flat":
        here = got.topk_ids >= 0
        factor = (got.topk_ids.float() + start + 1) if scaled else torch.ones_like(got.topk_weights, dtype=torch.float32)
        scale = torch.where(here, got.topk_weights.float() * factor, 0.0).sum(-1, keepdim=True)
        return (got.x.float() * scale).to(got.x.dtype)
    if got.layout == "padded":
        num_local = got.x.shape[0]
        factor = (torch.arange(num_local, device=got.x.device, dtype=torch.float32) + start + 1) if scaled else torch.ones(num_local)
        return (got.x.float() * factor.view(-1, 1, 1).to(got.x.device)).to(got.x.dtype)
    raise AssertionError(f"unknown layout {got.layout!r}")


def planned(world: int, hidden: int, num_experts: int, device_type: str = "", capability: str = "") -> Any:
    """The PlannedLayout the round trips run under: ep = world, at most 16
    tokens and top-k 4 per rank."""
    from plinth.api import PlannedLayout

    return PlannedLayout(
        world=world, dp=world, ep=world, local_world=world, device_type=device_type, capability=capability,
        hidden_size=hidden, num_experts=num_experts, top_k=4, max_tokens_per_step=16, max_num_seqs=16,
    )  # fmt: skip


def a2a_rank(rank: int, world: int, name: str, seed: int = 0, uneven: bool = True, device_type: str = "") -> list[tuple[bool, str, str]]:
    """One rank's round trips (run by ``run_ranks``): [(ok, what, detail)],
    with 3 experts a rank and, when ``uneven``, with one expert more than
    that (rank 0 owns 4: ``plinth.api.expert_ranges``)."""
    out: list[tuple[bool, str, str]] = []
    for num_experts in (3 * world, 3 * world + 1) if uneven else (3 * world,):
        tag = f"{num_experts} experts"
        out += [(ok, f"{tag}, {what}", detail) for ok, what, detail in _round_trips(rank, world, name, seed, num_experts, device_type)]
    return out


def _round_trips(rank: int, world: int, name: str, seed: int, num_experts: int, device_type: str) -> list[tuple[bool, str, str]]:
    import torch
    import torch.distributed as dist

    from plinth.api import SelectionContext, expert_ranges
    from plinth.testing.registration import discover_all

    out: list[tuple[bool, str, str]] = []
    entry = discover_all().get("a2a", name)
    cls = entry.load()
    hidden = 40
    ranges = expert_ranges(num_experts, world)
    per, start = len(ranges[rank]), ranges[rank].start
    ctx = SelectionContext(ep=world, layout=planned(world, hidden, num_experts, device_type))
    a2a = cls(ctx, group=dist.group.WORLD, num_experts=num_experts, hidden_size=hidden)
    a2a.reserve_buffers()  # every rank together, as the engine does at start-up
    g = torch.Generator().manual_seed(seed * 1000 + rank + num_experts * 7)

    def routing(tokens: int, top_k: int, allowed: list[int]) -> tuple[Any, Any]:
        scores = torch.rand(tokens, len(allowed), generator=g)
        pick = scores.topk(top_k, dim=-1).indices
        ids = torch.tensor(allowed)[pick]
        weights = torch.rand(tokens, top_k, generator=g).softmax(-1)
        return weights, ids

    last_rank_experts = set(ranges[-1])
    cases = [
        # (label, tokens on this rank, top_k, experts allowed)
        ("uneven tokens, the last rank's experts get none", 5 + 3 * rank, 2, [e for e in range(num_experts) if e not in last_rank_experts]),
        ("rank 1 sends nothing", 0 if rank == 1 else 7, 3, list(range(num_experts))),
        ("every token to rank 0's experts", 4 + rank, 2, list(ranges[0])),
        ("one token, top-k over every rank", 1, min(num_experts, world + 1), list(range(num_experts))),
    ]
    for label, tokens, top_k, allowed in cases:
        weights, ids = routing(tokens, top_k, allowed)
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
            x = torch.randn(tokens, hidden, generator=g).to(dtype)
            for decode in (False, True):
                for scaled in (False, True):
                    what = f"{label}: {'decode' if decode else 'prefill'}, {str(dtype).removeprefix('torch.')}, {'f_e = (e+1) x' if scaled else 'identity'} experts"
                    got, handle = a2a.dispatch(x, ids, weights, decode=decode)
                    problems = []
                    if got.layout == "flat":
                        local = got.topk_ids[got.topk_ids >= 0]
                        if local.numel() and (int(local.max()) >= per):
                            problems.append("local ids out of range")
                        if torch.bincount(local, minlength=per).tolist() != got.counts.tolist():
                            problems.append(f"counts {got.counts.tolist()} do not match the ids received")
                    elif got.layout == "padded":
                        if got.x.shape[0] != per or got.counts.numel() != per:
                            problems.append(f"padded shape {tuple(got.x.shape)} for {per} local experts")
                    y = a2a.combine(_experts(got, start, scaled), handle)
                    want = _expected(x, weights, ids, scaled)
                    err = float((y.float() - want).abs().max()) if tokens else 0.0
                    bound = tol * (1 + float(want.abs().max())) if tokens else 0.0
                    if tuple(y.shape) != (tokens, hidden):
                        problems.append(f"combine gave shape {tuple(y.shape)}")
                    elif err > bound:
                        problems.append(f"max abs error {err:.3g} > {bound:.3g}")
                    out.append((not problems, f"{what} ({got.layout})", "; ".join(problems) or f"max abs error {err:.3g}"))
    # float8 travels as bytes: what arrives is what was sent
    if hasattr(torch, "float8_e4m3fn"):
        weights, ids = routing(6, 2, list(range(num_experts)))
        x = torch.randn(6, hidden, generator=g).to(torch.float8_e4m3fn)
        got, handle = a2a.dispatch(x, ids, weights, decode=False)
        ok = got.x.dtype == torch.float8_e4m3fn
        if ok and got.layout == "flat":  # identity experts in bfloat16, back to the senders
            y = a2a.combine(_experts(type(got)(got.layout, got.x.to(torch.bfloat16), got.counts, got.topk_ids, got.topk_weights), start, False), handle)
            ok = float((y.float() - _expected(x.to(torch.bfloat16), weights, ids, False)).abs().max()) < 3e-2 * 8
        out.append((ok, "float8 dispatch delivers the bytes sent", str(got.x.dtype)))
    return out


def check_a2a(
    name: str, *, worlds: tuple[int, ...] = (2, 4), backend: str | None = None, timeout: float = 180.0, uneven: bool = True,
    accelerator: str = "auto",
) -> Report:  # fmt: skip
    """``name``'s dispatch/combine round trips on ``worlds`` real processes
    (the group backend: ``accelerator``'s, by default the best available's, gloo on CPU),
    with expert counts the group divides and, when ``uneven``, one it does
    not (every a2a plugin should take those; DeepEP's kernels cannot)."""
    from plinth.api import SelectionContext
    from plinth.testing.distributed import run_ranks
    from plinth.testing.registration import discover_all

    report = Report(f"a2a {name}")
    registry = discover_all()
    entry = registry.get("a2a", name)
    info = registry.select("accelerator", accelerator, SelectionContext()).load()().info()
    reasons = entry.evaluate(SelectionContext(ep=max(worlds), layout=planned(max(worlds), 40, 3 * max(worlds), info.device_type, info.capability)))
    if reasons:
        report.skip(f"unavailable here: {'; '.join(reasons)}")
        return report.raise_for_problems()
    group_backend = backend if backend is not None else str(info.dist_backend)
    for world in worlds:
        per_rank = run_ranks(a2a_rank, world, name, 0, uneven, info.device_type, backend=group_backend, timeout=timeout)
        for rank, results in enumerate(per_rank):
            for ok, what, detail in results:
                report.expect(ok, f"{world} ranks, rank {rank}: {what}", detail)
    return report.raise_for_problems()
