"""Running a gemma model without the engine: the torch backend's op table
and a prompt prefilled into shuffled KV pages, every position's logits."""

from __future__ import annotations

import random

import torch
from plinth.api import (
    AttentionBackend,
    AttentionMetadata,
    LoadContext,
    ModelSource,
    OpTable,
    SelectionContext,
    load_hf_config,
)
from plinth_plugin_gemma.loader import GemmaLoader


def torch_ops() -> OpTable:
    """The torch backend's op table, as the engine hands it to a model."""
    from plinth_plugin_torch.backend import TorchBackend

    return OpTable(TorchBackend(SelectionContext()).ops())


def torch_attention() -> AttentionBackend:
    """The torch backend's attention backend."""
    from plinth_plugin_torch.attention import TorchAttention

    return TorchAttention(SelectionContext())


def load_ours(path: str, ops, *, dtype: torch.dtype = torch.float32):
    """The model as the gemma loader builds it from a folder or a .gguf file."""
    if path.endswith(".gguf"):
        source = ModelSource(path=path, format="gguf", architecture="gemma3")
    else:
        cfg_json = load_hf_config(path)
        source = ModelSource(path=path, format="hf", architecture=cfg_json["architectures"][0], hf_config=cfg_json)
    loader = GemmaLoader()
    cfg = loader.load_config(source)
    model = loader.load_model(source, cfg, LoadContext(device=torch.device("cpu"), dtype=dtype, ops=ops, attention=torch_attention(), progress=False))
    return model, cfg


@torch.no_grad()
def paged_hidden(model, ops, cfg, prompt: list[int], *, page_size: int, chunk: int) -> torch.Tensor:
    """Every position's final hidden state, the prompt prefilled ``chunk``
    tokens per step into shuffled pages (later chunks attend to the cached
    prefix)."""
    num_pages = -(-len(prompt) // page_size) + 2
    attention = model.attention  # the attention backend the model was built with lays out the pages
    caches = [
        attention.allocate(num_pages=num_pages, page_size=page_size, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                           v_head_dim=cfg.head_dim, dtype=model.embed.dtype, device=torch.device("cpu"))
        for _ in range(cfg.num_layers)
    ]
    pages = list(range(num_pages))
    random.Random(page_size).shuffle(pages)
    table = torch.tensor([pages], dtype=torch.int32)
    out = []
    for start in range(0, len(prompt), chunk):
        end = min(start + chunk, len(prompt))
        positions = torch.arange(start, end)
        slots = torch.tensor([pages[p // page_size] * page_size + p % page_size for p in range(start, end)])
        meta = AttentionMetadata(
            positions=positions, slot_mapping=slots, query_start_loc=torch.tensor([0, end - start], dtype=torch.int32),
            seq_lens=torch.tensor([end], dtype=torch.int32), block_tables=table, page_size=page_size,
            max_query_len=end - start, max_seq_len=end, query_lens_cpu=[end - start], seq_lens_cpu=[end],
        )
        meta.plan = attention.build_plan(meta)
        out.append(model(torch.tensor(prompt[start:end]), positions, caches, meta))
    return torch.cat(out)


def paged_logits(model, ops, cfg, prompt: list[int], *, page_size: int, chunk: int) -> torch.Tensor:
    """Every position's logits (as ``paged_hidden``)."""
    return model.compute_logits(paged_hidden(model, ops, cfg, prompt, page_size=page_size, chunk=chunk))
