"""How this rank's share of a model is cut (tensor and expert parallelism),
and the collectives the layers call. Plain torch.distributed over the groups
the engine hands the loader in ``LoadContext``; with one rank every helper is
the identity and no collective runs.

Tensor parallelism (tp ranks of one group): attention heads split evenly
(q/k/v column-parallel, o row-parallel, one all-reduce), KV heads split too,
or replicated when there are fewer than tp (rank r keeps KV head
r * kv_heads // tp, the one its query heads read); dense MLPs column/row
parallel (one all-reduce); the vocabulary split in equal slices for the
embedding (masked lookup, all-reduce) and the output head (all-gather).
Experts: with ep = 1 each expert's intermediate dimension splits over tp
like a dense MLP; with ep > 1 rank r of the ep group keeps its contiguous
run of experts whole (``plinth.api.expert_ranges``: when ep does not divide
E the first E % ep ranks keep one more) and tokens travel through the a2a
plugin (tp ranks of a group hold the same tokens, so each dispatches only
its 1/tp slice of them and the tp all-reduce puts the slices together).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from plinth.api import ConfigError, LoadContext, all_reduce_sum, local_experts


@dataclass
class Parallel:
    tp_rank: int = 0
    tp_size: int = 1
    tp_group: Any = None
    ep_rank: int = 0
    ep_size: int = 1
    ep_group: Any = None
    a2a: Any = None
    #: deterministic serving: the tp sum in rank order (``plinth.api.all_reduce_sum``)
    fixed_order: bool = False

    @classmethod
    def from_ctx(cls, ctx: LoadContext) -> "Parallel":
        return cls(ctx.tp_rank, ctx.tp_size, ctx.tp_group, ctx.ep_rank, ctx.ep_size, ctx.ep_group, ctx.a2a, ctx.deterministic)

    # ---- collectives ------------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(x, self.tp_group if self.tp_size > 1 else None, fixed_order=self.fixed_order)

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every tp rank's x along the last dimension."""
        if self.tp_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.tp_group)
        return torch.cat(parts, -1)

    # ---- how weights are cut --------------------------------------------------------------------

    def check(self, num_heads: int, num_kv_heads: int, num_experts: int) -> None:
        tp = self.tp_size
        if num_heads % tp:
            raise ConfigError(f"tp={tp} does not divide the {num_heads} attention heads")
        if num_kv_heads % tp and tp % num_kv_heads:
            raise ConfigError(f"tp={tp} and the {num_kv_heads} KV heads: one must divide the other")
        self.local_experts(num_experts)  # refuses an ep the experts cannot split over

    def heads(self, num_heads: int) -> range:
        per = num_heads // self.tp_size
        return range(self.tp_rank * per, (self.tp_rank + 1) * per)

    def kv_heads(self, num_kv_heads: int) -> range:
        if num_kv_heads >= self.tp_size:
            return self.heads(num_kv_heads)
        first = self.tp_rank * num_kv_heads // self.tp_size
        return range(first, first + 1)

    def split(self, size: int) -> slice:
        """This tp rank's equal slice of a dimension tp divides."""
        if size % self.tp_size:
            raise ConfigError(f"tp={self.tp_size} does not divide a dimension of size {size}")
        per = size // self.tp_size
        return slice(self.tp_rank * per, (self.tp_rank + 1) * per)

    def vocab(self, vocab_size: int) -> tuple[int, int]:
        """(first id, rows) of this rank's vocabulary slice; every rank has
        the same number of rows (the last is padded with zero rows)."""
        per = -(-vocab_size // self.tp_size)
        return self.tp_rank * per, per

    def local_experts(self, num_experts: int) -> range:
        """This ep rank's experts (uneven splits as ``expert_ranges`` says)."""
        return local_experts(num_experts, self.ep_rank, self.ep_size, has_a2a=self.a2a is not None)


def head_rows(weight: torch.Tensor, heads: range, head_dim: int) -> torch.Tensor:
    """Rows (dim 0) of the given heads; columns when weight is [out, in] of an
    output projection are taken with ``head_cols``."""
    return weight[heads.start * head_dim : heads.stop * head_dim]


def head_cols(weight: torch.Tensor, heads: range, head_dim: int) -> torch.Tensor:
    return weight[:, heads.start * head_dim : heads.stop * head_dim]


def vocab_rows(weight: torch.Tensor, first: int, rows: int) -> torch.Tensor:
    """Rows first .. first + rows - 1, zero rows past the end."""
    part = weight[first : first + rows]
    if part.shape[0] < rows:
        part = torch.cat((part, part.new_zeros(rows - part.shape[0], *part.shape[1:])))
    return part
