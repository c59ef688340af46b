"""A deterministic toy model for testing the engine without any plugin.

Each token's "K/V" is its id, written into the paged cache; the output at
position p is the sum of the ids at positions <= p, read back through the
block table. The next token is ``(31 * sum + p) % VOCAB``. Any paging,
chunking, preemption or prefix-cache mistake changes some sum, so the engine's
outputs must equal ``reference()`` exactly.

With ``window=W`` the toy has a second layer that reads only the last W
positions (a sliding window, its own KV-cache group whose old pages are
freed): the next token then also depends on the sum of the last W ids, so
a page freed too early (read as the null page's zeros) or reused while still
in the window changes the output.
"""

from __future__ import annotations

import torch
from plinth.api import (
    PAGES_FIRST,
    AttentionBackend,
    AttentionPlan,
    FullAttentionSpec,
    ModelConfig,
    SelectionContext,
    SlidingWindowSpec,
)
from plinth.engine.engine import LLMEngine
from plinth.engine.executor import LocalExecutor
from plinth.engine.kv_cache_manager import KVCacheManager
from plinth.engine.model_runner import ModelRunner
from plinth.engine.scheduler import Scheduler

VOCAB = 97
EOS = 0


def next_token(tokens: list[int], window: int | None = None) -> int:
    recent = 17 * sum(tokens[-window:]) if window else 0
    return (31 * (sum(tokens) + recent) + len(tokens) - 1) % VOCAB


def reference(prompt: list[int], max_tokens: int, *, eos: bool = True, window: int | None = None) -> list[int]:
    tokens = list(prompt)
    out = []
    for _ in range(max_tokens):
        t = next_token(tokens, window)
        out.append(t)
        tokens.append(t)
        if eos and t == EOS:
            break
    return out


def _attention(q, k, v, kv_cache, meta, *, sliding_window=None):
    k_pages, v_pages = kv_cache
    ps = meta.page_size
    flat = v_pages.view(-1, *v_pages.shape[2:])
    flat[meta.slot_mapping] = v
    out = torch.empty_like(q)
    start = 0
    for i, (qlen, slen) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        pos = torch.arange(slen)
        slots = meta.block_tables[i].long()[pos // ps] * ps + pos % ps
        ctx = flat[slots, 0, 0].double().cumsum(0)
        if sliding_window:  # the sum of the last W ids only
            ctx = ctx - torch.cat([torch.zeros(sliding_window, dtype=ctx.dtype), ctx])[:slen]
        out[start : start + qlen, 0, 0] = ctx[slen - qlen : slen].to(out.dtype)
        start += qlen
    return out


class ToyAttention(AttentionBackend[AttentionPlan]):
    """Pages [pages, page_size, heads, dim]; allocation and page copies as the contract's defaults do them."""

    layout = PAGES_FIRST
    dtypes = ("float64",)
    plan_type = AttentionPlan

    def build_plan(self, meta):
        return AttentionPlan()

    def forward(self, q, k, v, kv_cache, meta, *, scale=1.0, sliding_window=None, logit_cap=None):
        return _attention(q, k, v, kv_cache, meta, sliding_window=sliding_window)


TOY_ATTENTION = ToyAttention(SelectionContext())


class ToyModel(torch.nn.Module):
    def __init__(self, window: int | None = None) -> None:
        super().__init__()
        self.attention = TOY_ATTENTION
        self.window = window

    def forward(self, input_ids, positions, kv_caches, meta):
        x = input_ids.to(torch.float64).view(-1, 1, 1)
        s = self.attention.forward(x, x, x, kv_caches[0], meta.for_layer(0), scale=1.0)
        if self.window:
            s = s + 17 * self.attention.forward(x, x, x, kv_caches[1], meta.for_layer(1), scale=1.0, sliding_window=self.window)
        self._positions = positions
        return torch.stack([s.view(-1), positions.to(torch.float64)], dim=1)

    def kv_cache_specs(self):
        full = FullAttentionSpec(num_kv_heads=1, head_dim=1)
        return [full] if self.window is None else [full, SlidingWindowSpec(num_kv_heads=1, head_dim=1, window=self.window)]

    def compute_logits(self, hidden):
        nxt = ((31 * hidden[:, 0].round().long() + hidden[:, 1].long()) % VOCAB).long()
        logits = torch.full((hidden.shape[0], VOCAB), -10.0)
        logits[torch.arange(hidden.shape[0]), nxt] = 10.0
        return logits


class ToyTokenizer:
    """Token t decodes to one character; token 0 is EOS (special)."""

    eos_token_ids = (EOS,)
    bos_token_id = None

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % (VOCAB - 1) + 1 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(0x40 + t) for t in ids if not (skip_special_tokens and t == EOS))


def toy_engine(
    *, page_size=4, num_pages=64, max_num_seqs=8, max_num_batched_tokens=64, caching=True, max_model_len=4096,
    connector=None, connector_options=None, window=None, window_pages=None,
):
    """``connector(layout) -> KVConnector``: attach a KV connector. ``window``:
    add a sliding-window layer (its group gets ``window_pages`` pages, or
    ``num_pages``)."""
    cfg = ModelConfig(
        architecture="Toy", vocab_size=VOCAB, hidden_size=1, num_layers=1, num_heads=1, num_kv_heads=1,
        head_dim=1, max_model_len=max_model_len, eos_token_ids=(EOS,),
    )
    pages = num_pages if window is None else [num_pages, window_pages or num_pages]
    runner = ModelRunner(
        ToyModel(window), TOY_ATTENTION, cfg, device=torch.device("cpu"), dtype=torch.float64, num_pages=pages, page_size=page_size,
        enable_caching=caching,
    )
    kv = KVCacheManager(runner.kv_groups, copy_pages=runner.copy_pages)
    if connector is not None:
        from plinth.api import KVLayout
        from plinth.engine.kv_transfer import HEADER_BYTES, KVTransfer

        pb = runner.page_bytes()
        layout = KVLayout(model_id="toy", fingerprint=f"toy-{page_size}", page_size=page_size, page_bytes=pb, value_bytes=HEADER_BYTES + pb)
        kv.connector = KVTransfer(
            connector(layout), layout, read_pages=runner.read_pages, write_pages=runner.write_pages, options=connector_options
        )
    sched = Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    return LLMEngine(executor=LocalExecutor(runner), tokenizer=ToyTokenizer(), model_config=cfg, scheduler=sched, max_model_len=max_model_len)


def run_all(engine: LLMEngine, max_steps: int = 10_000):
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert not engine.has_unfinished(), f"requests left after {max_steps} steps: {engine.stats()}"
    return done
