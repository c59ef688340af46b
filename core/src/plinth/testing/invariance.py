"""Batch invariance (``--deterministic``): a row's result must be bit for bit
the same whatever other rows share the call, however many, and wherever the
row sits among them.

``batch_invariance_problems(fn, rows)`` runs ``fn`` on one probe row alone
and then inside batches of other rows of the pool at several sizes and
positions, and lists every batch where the probe's output is not
``torch.equal`` to the lone result. ``fn`` takes the row-aligned tensors of a
batch (each [M, ...]) and returns a tensor or a tuple of tensors [M, ...].
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

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
