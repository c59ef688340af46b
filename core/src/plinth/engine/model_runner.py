"""Runs one scheduled batch through the model: builds the flat token batch
and its paging metadata, calls the model, returns the logits rows asked for."""

from __future__ import annotations

from typing import Any
from typing import Sequence as Seq

import numpy as np
import torch

from plinth.api import AttentionMetadata, ModelConfig
from plinth.engine.scheduler import ScheduledBatch


def kv_page_bytes(cfg: ModelConfig, page_size: int, dtype: torch.dtype, tp: int = 1) -> int:
    """Bytes one page takes across all layers (K and V)."""
    heads = max(1, cfg.num_kv_heads // tp)
    v_dim = cfg.head_dim if cfg.v_head_dim is None else cfg.v_head_dim
    elem = torch.empty((), dtype=dtype).element_size()
    return cfg.num_layers * page_size * heads * (cfg.head_dim + v_dim) * elem


class ModelRunner:
    def __init__(
        self,
        model: Any,
        ops: Any,
        cfg: ModelConfig,
        *,
        device: torch.device,
        dtype: torch.dtype,
        num_pages: int,
        page_size: int,
        tp: int = 1,
    ) -> None:
        self.model = model
        self.ops = ops
        self.cfg = cfg
        self.device = device
        self.dtype = dtype
        self.page_size = page_size
        heads = max(1, cfg.num_kv_heads // tp)
        v_dim = cfg.head_dim if cfg.v_head_dim is None else cfg.v_head_dim
        # the backend's layout; the engine only counts pages
        self.kv_caches: list[tuple[Any, Any]] = [
            ops.allocate_kv_cache(
                num_pages=num_pages, page_size=page_size, num_kv_heads=heads, head_dim=cfg.head_dim,
                v_head_dim=v_dim, dtype=dtype, device=device,
            )
            for _ in range(cfg.num_layers)
        ]
        self.page_dims = self._find_page_dims(heads, v_dim)
        #: keep the hidden states of the logits rows of the last step (speculative proposers that ask)
        self.keep_hidden = False
        self.last_hidden: torch.Tensor | None = None

    def _find_page_dims(self, heads: int, v_dim: int) -> list[int | None]:
        """The page dimension of each tensor of a layer's cache, found by
        allocating two tiny caches that differ only in their page count (the
        backend owns the layout; every page is one index of one dimension)."""
        kw = dict(page_size=self.page_size, num_kv_heads=heads, head_dim=self.cfg.head_dim, v_head_dim=v_dim, dtype=self.dtype, device=self.device)
        a = self.ops.allocate_kv_cache(num_pages=2, **kw)
        b = self.ops.allocate_kv_cache(num_pages=3, **kw)
        dims: list[int | None] = []
        for x, y in zip(a, b):
            if x is None:
                dims.append(None)
                continue
            diff = [d for d in range(x.dim()) if x.shape[d] != y.shape[d]]
            dims.append(diff[0] if len(diff) == 1 and x.shape[diff[0]] == 2 else -1)
        return dims

    def _page_tensors(self):
        for layer in self.kv_caches:
            for t, dim in zip(layer, self.page_dims):
                if t is not None:
                    if dim is None or dim < 0:
                        raise RuntimeError("this backend's KV layout has no page dimension: pages cannot be saved or loaded")
                    yield t, dim

    def page_bytes(self) -> int:
        """Bytes of one page across every layer, as read_pages returns them."""
        return sum(t.numel() // t.shape[dim] * t.element_size() for t, dim in self._page_tensors())

    def page_shapes(self) -> list[tuple[int, ...]]:
        """One page's shape in each tensor (part of the KV layout's identity)."""
        return [tuple(t.movedim(dim, 0).shape[1:]) for t, dim in self._page_tensors()]

    @torch.inference_mode()
    def read_pages(self, pages: Seq[int]) -> torch.Tensor:
        """A CPU copy of whole pages: uint8 [len(pages), page_bytes]."""
        idx = torch.tensor(list(pages), dtype=torch.long, device=self.device)
        parts = []
        for t, dim in self._page_tensors():
            x = t.index_select(dim, idx).movedim(dim, 0).contiguous().cpu()
            parts.append(x.view(len(pages), -1).view(torch.uint8))
        return torch.cat(parts, dim=1)

    @torch.inference_mode()
    def write_pages(self, pages: Seq[int], data: torch.Tensor) -> None:
        """Fill whole pages from what read_pages returned."""
        idx = torch.tensor(list(pages), dtype=torch.long, device=self.device)
        off = 0
        n = len(pages)
        for t, dim in self._page_tensors():
            shape = t.movedim(dim, 0).shape[1:]
            nbytes = t.numel() // t.shape[dim] * t.element_size()
            chunk = data[:, off : off + nbytes].contiguous().view(t.dtype).view(n, *shape)
            t.index_copy_(dim, idx, chunk.movedim(0, dim).to(t.device))
            off += nbytes

    def build_metadata(self, batch: ScheduledBatch) -> tuple[torch.Tensor, AttentionMetadata]:
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
        max_pages = max([1, *(len(t) for t in batch.block_tables)])
        tables = np.zeros((len(batch.seqs), max_pages), dtype=np.int64)
        for i, table in enumerate(batch.block_tables):
            tables[i, : len(table)] = table
        q_lens_np = np.asarray(q_lens, dtype=np.int64)
        seq_index = np.repeat(np.arange(len(q_lens)), q_lens_np)
        cu = np.zeros(len(q_lens) + 1, dtype=np.int64)
        np.cumsum(q_lens_np, out=cu[1:])
        positions = starts[seq_index] + (np.arange(cu[-1]) - cu[seq_index])
        slots = tables[seq_index, positions // ps] * ps + positions % ps

        dev = self.device
        meta = AttentionMetadata(
            positions=torch.from_numpy(positions).to(dev),
            slot_mapping=torch.from_numpy(slots).to(dev),
            query_start_loc=torch.from_numpy(cu.astype(np.int32)).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(tables.astype(np.int32)).to(dev),
            page_size=ps,
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=q_lens,
            seq_lens_cpu=seq_lens,
        )
        return torch.tensor(ids, dtype=torch.long, device=dev), meta

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, logit_rows: Seq[int]) -> torch.Tensor:
        """Forward the batch; logits (float32) of the flat token rows asked for."""
        input_ids, meta = self.build_metadata(batch)
        self.ops.prepare_attention(meta)
        hidden = self.model(input_ids, meta.positions, self.kv_caches, meta)
        if not logit_rows:
            return torch.empty(0, self.cfg.vocab_size)
        rows = torch.tensor(list(logit_rows), dtype=torch.long, device=hidden.device)
        picked = hidden.index_select(0, rows)
        if self.keep_hidden:  # a proposer reading the target's hidden states (MTP, EAGLE heads)
            self.last_hidden = picked
        return self.model.compute_logits(picked).float().cpu()

    @torch.inference_mode()
    def copy_pages(self, src: Seq[int], dst: Seq[int]) -> None:
        self.ops.copy_pages(self.kv_caches, torch.tensor(list(src)), torch.tensor(list(dst)))
