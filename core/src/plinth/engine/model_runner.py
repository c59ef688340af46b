"""Runs one scheduled batch through the model: builds the flat token batch
and its paging metadata, calls the model, returns the logits rows asked for."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from typing import Sequence as Seq

import numpy as np
import torch

from plinth.api import AttentionBackend, AttentionMetadata, ModelConfig
from plinth.engine.kv_cache_manager import KVCacheGroup, forgets, make_group
from plinth.engine.scheduler import ScheduledBatch
from plinth.errors import ConfigError

if TYPE_CHECKING:
    from plinth.api import KVCacheSpec


def kv_cache_specs(model: Any) -> list["KVCacheSpec | None"]:
    """Per layer, the cache the model says it keeps (``CausalLM.kv_cache_specs``)."""
    describe = getattr(model, "kv_cache_specs", None)
    if describe is None:
        raise ConfigError(f"{type(model).__name__} does not describe its KV cache: it needs kv_cache_specs() (see plinth.api.CausalLM)")
    return list(describe())


def spec_groups(specs: Seq["KVCacheSpec | None"]) -> list[tuple["KVCacheSpec", tuple[int, ...]]]:
    """Layers with equal specs (layers with none are left out): groups that
    keep every token first (the first is the one the pool statistics
    report), then those that forget, each in order of first appearance."""
    groups: dict[Any, list[int]] = {}
    for i, spec in enumerate(specs):
        if spec is not None:
            groups.setdefault(spec, []).append(i)
    return sorted(((spec, tuple(layers)) for spec, layers in groups.items()), key=lambda g: forgets(g[0]))


def kv_cache_groups(model: Any, num_pages: int | Seq[int], page_size: int, *, enable_caching: bool) -> list[KVCacheGroup]:
    """The KV-cache groups of a model's layers (``spec_groups``), each over a
    fresh pool of its pages (``num_pages``: of every group, or of each in
    turn): what a KV-cache manager, or a runner's allocation, is built from."""
    grouped = spec_groups(kv_cache_specs(model))
    counts = [num_pages] * len(grouped) if isinstance(num_pages, int) else list(num_pages)
    if len(counts) != len(grouped):
        raise ValueError(f"{len(counts)} page counts for {len(grouped)} KV-cache groups")
    return [make_group(spec, layers, n, page_size, enable_caching=enable_caching) for (spec, layers), n in zip(grouped, counts)]


class ModelRunner:
    def __init__(
        self,
        model: Any,
        attention: AttentionBackend[Any],
        cfg: ModelConfig,
        *,
        device: torch.device,
        dtype: torch.dtype,
        num_pages: int | Seq[int],
        page_size: int,
        enable_caching: bool = True,
    ) -> None:
        """``num_pages``: usable pages of every KV-cache group, or of each in turn."""
        self.model = model
        #: the attention backend: it lays out and copies the pages and plans each step
        self.attention = attention
        self.cfg = cfg
        self.device = device
        self.dtype = dtype
        self.page_size = page_size
        specs = kv_cache_specs(model)
        grouped = spec_groups(specs)
        #: the KV-cache groups: their pools are this runner's pages (a KV-cache manager may draw from them)
        self.kv_groups: list[KVCacheGroup] = kv_cache_groups(model, num_pages, page_size, enable_caching=enable_caching)
        self.layer_groups = [0] * len(specs)
        # the attention backend's layout; the engine only counts pages
        self.kv_caches: list[tuple[Any, Any] | None] = [None] * len(specs)
        for gi, (g, (spec, _)) in enumerate(zip(self.kv_groups, grouped)):
            for i in g.layers:
                self.layer_groups[i] = gi
                self.kv_caches[i] = attention.allocate(
                    num_pages=g.pool.num_pages, page_size=page_size, dtype=dtype, device=device, **spec.allocation()
                )
        #: the page dimension of each page tensor, as the layout declares it
        self.page_dim = attention.layout.page_dim
        #: keep the hidden states of the logits rows of the last step (speculative proposers that ask)
        self.keep_hidden = False
        self.last_hidden: torch.Tensor | None = None

    def _page_tensors(self):
        for g in self.kv_groups:
            yield from self._group_tensors(g)

    def _group_tensors(self, g: KVCacheGroup):
        for i in g.layers:
            for t in self.kv_caches[i] or ():
                if t is not None:
                    yield t, self.page_dim

    def page_bytes(self) -> int:
        """Bytes of one page across every layer of every group, as read_pages returns them."""
        return sum(t.numel() // t.shape[dim] * t.element_size() for t, dim in self._page_tensors())

    def page_shapes(self) -> list[tuple[int, ...]]:
        """One page's shape in each tensor (part of the KV layout's identity)."""
        return [tuple(t.movedim(dim, 0).shape[1:]) for t, dim in self._page_tensors()]

    @torch.inference_mode()
    def read_pages(self, pages: Seq[Seq[int]]) -> torch.Tensor:
        """A CPU copy of whole pages: uint8 [len(pages), page_bytes]; each
        entry of ``pages`` is one page of a sequence, as its page in each group."""
        parts = []
        for gi, g in enumerate(self.kv_groups):
            idx = torch.tensor([p[gi] for p in pages], dtype=torch.long, device=self.device)
            for t, dim in self._group_tensors(g):
                x = t.index_select(dim, idx).movedim(dim, 0).contiguous().cpu()
                parts.append(x.view(len(pages), -1).view(torch.uint8))
        return torch.cat(parts, dim=1)

    @torch.inference_mode()
    def write_pages(self, pages: Seq[Seq[int]], data: torch.Tensor) -> None:
        """Fill whole pages from what read_pages returned."""
        off = 0
        n = len(pages)
        for gi, g in enumerate(self.kv_groups):
            idx = torch.tensor([p[gi] for p in pages], dtype=torch.long, device=self.device)
            for t, dim in self._group_tensors(g):
                shape = t.movedim(dim, 0).shape[1:]
                nbytes = t.numel() // t.shape[dim] * t.element_size()
                chunk = data[:, off : off + nbytes].contiguous().view(t.dtype).view(n, *shape)
                t.index_copy_(dim, idx, chunk.movedim(0, dim).to(t.device))
                off += nbytes

    def build_metadata(self, batch: ScheduledBatch) -> tuple[torch.Tensor, AttentionMetadata]:
        """The step's tokens and metadata; with more than one KV-cache group,
        ``meta.groups`` holds each group's block tables and slot mapping."""
        ps = self.page_size
        ids: list[int] = []
        starts = np.empty(len(batch.seqs), dtype=np.int64)
        q_lens = list(batch.num_tokens)
        seq_lens: list[int] = []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            c = seq.num_computed
            ids.extend(seq.token_ids[c : c + n])
            if c + n > len(seq.token_ids):  # a decode with speculative proposals after its last token
                ids.extend(seq.spec_tokens[: c + n - len(seq.token_ids)])
            starts[i] = c
            seq_lens.append(c + n)
        q_lens_np = np.asarray(q_lens, dtype=np.int64)
        seq_index = np.repeat(np.arange(len(q_lens)), q_lens_np)
        cu = np.zeros(len(q_lens) + 1, dtype=np.int64)
        np.cumsum(q_lens_np, out=cu[1:])
        positions = starts[seq_index] + (np.arange(cu[-1]) - cu[seq_index])

        dev = self.device
        shared = dict(
            positions=torch.from_numpy(positions).to(dev),
            query_start_loc=torch.from_numpy(cu.astype(np.int32)).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            page_size=ps,
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=q_lens,
            seq_lens_cpu=seq_lens,
        )
        metas = []
        for gi in range(len(self.kv_groups)):
            max_pages = max([1, *(len(t[gi]) for t in batch.block_tables)])
            tables = np.zeros((len(batch.seqs), max_pages), dtype=np.int64)
            for i, per_group in enumerate(batch.block_tables):
                tables[i, : len(per_group[gi])] = per_group[gi]
            slots = tables[seq_index, positions // ps] * ps + positions % ps
            metas.append(
                AttentionMetadata(
                    slot_mapping=torch.from_numpy(slots).to(dev),
                    block_tables=torch.from_numpy(tables.astype(np.int32)).to(dev),
                    **shared,  # type: ignore[arg-type]
                )
            )
        meta = metas[0]
        if len(metas) > 1:
            meta.groups = metas
            meta.layer_groups = self.layer_groups
        return torch.tensor(ids, dtype=torch.long, device=dev), meta

    def prepare(self, meta: AttentionMetadata) -> None:
        """The attention backend's plan of the step, once per KV-cache group."""
        for m in meta.groups or (meta,):
            m.plan = self.attention.build_plan(m)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, logit_rows: Seq[int]) -> torch.Tensor:
        """Forward the batch; logits (float32) of the flat token rows asked
        for, on the model's device (the sampler works there; only sampled
        ids and requested logprobs go to the host)."""
        input_ids, meta = self.build_metadata(batch)
        self.prepare(meta)
        hidden = self.model(input_ids, meta.positions, self.kv_caches, meta)
        if not logit_rows:
            return torch.empty(0, self.cfg.vocab_size)
        rows = torch.tensor(list(logit_rows), dtype=torch.long, device=hidden.device)
        picked = hidden.index_select(0, rows)
        if self.keep_hidden:  # a proposer reading the target's hidden states (MTP, EAGLE heads)
            self.last_hidden = picked
        return self.model.compute_logits(picked).float()

    @torch.inference_mode()
    def copy_pages(self, src: Seq[Seq[int]], dst: Seq[Seq[int]]) -> None:
        """Copy whole pages src[g][i] -> dst[g][i] in the layers of group g."""
        for g, s, d in zip(self.kv_groups, src, dst):
            if s:
                self.attention.copy_pages([self.kv_caches[i] for i in g.layers], torch.tensor(list(s)), torch.tensor(list(d)))
