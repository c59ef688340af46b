"""The attention-backend contract (plinth.contract.attention): declared
layouts and page sizes, the typed plan, how start-up picks the attention
backend and holds a backend that shares the reference's pages to the
reference's layout, and attention problems judged with the backend."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from plinth.api import (  # noqa: E402
    BASE_OPS,
    HEADS_FIRST,
    PAGES_FIRST,
    AttentionBackend,
    AttentionPlan,
    Backend,
    BackendDescriptor,
    FullAttentionSpec,
    KVCacheLayout,
    ModelConfig,
    OpTable,
    PageSizes,
    SelectionContext,
    hookimpl,
)
from plinth.engine.model_runner import ModelRunner  # noqa: E402
from plinth.engine.startup import resolve_attention  # noqa: E402
from plinth.errors import PluginError  # noqa: E402
from plinth.testing import attention_metadata  # noqa: E402
from plugin_fakes import impl_module, plugin_module, registry_of  # noqa: E402


def test_a_layout_gives_the_shape_the_page_dimension_and_a_token_major_view():
    assert HEADS_FIRST.shape(num_pages=5, page_size=4, num_kv_heads=2, head_dim=8) == (2, 5, 4, 8)
    assert PAGES_FIRST.shape(num_pages=5, page_size=4, num_kv_heads=2, head_dim=8) == (5, 4, 2, 8)
    assert (HEADS_FIRST.page_dim, PAGES_FIRST.page_dim) == (1, 0)
    pages = torch.arange(2 * 5 * 4 * 8).view(2, 5, 4, 8)
    view = HEADS_FIRST.token_major(pages)
    assert view.shape == (5, 4, 2, 8) and view[3, 1, 1, 7] == pages[1, 3, 1, 7] and view.data_ptr() == pages.data_ptr()
    with pytest.raises(ValueError, match="each once"):
        KVCacheLayout(("pages", "pages", "heads", "dim"))


def test_page_sizes_say_why_they_refuse():
    rule = PageSizes(minimum=16, power_of_two=True)
    assert [rule.problem(n) for n in (16, 32, 128)] == [None, None, None]
    assert rule.problem(48) == "page size 48 is not at least 16 and a power of two"
    assert rule.problem(8) is not None and PageSizes().problem(7) is None
    assert PageSizes(multiple_of=8).problem(12) == "page size 12 is not a multiple of 8"


@dataclass
class CountPlan(AttentionPlan):
    step: int


class RefAttention(AttentionBackend[CountPlan]):
    """A reference over HEADS_FIRST pages: out = q (the pages are written)."""

    plan_type = CountPlan
    built = 0

    def build_plan(self, meta):
        type(self).built += 1
        return CountPlan(type(self).built)

    def forward(self, q, k, v, kv_cache, meta, *, scale, sliding_window=None, logit_cap=None):
        self.plan(meta)
        heads, num_pages, page_size, dim = kv_cache[0].shape
        kv_cache[0].view(heads, num_pages * page_size, dim).index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
        return q


class PickyAttention(AttentionBackend[CountPlan]):
    """Takes powers of two from 16 and no windowed model; shares the reference's pages."""

    page_sizes = PageSizes(minimum=16, power_of_two=True)
    dtypes = ("float32",)
    shares_reference_pages = True
    plan_type = CountPlan

    @classmethod
    def problems(cls, ctx):
        windowed = ctx.model is not None and ctx.model.sliding_window
        return super().problems(ctx) + (["sliding windows are not taken"] if windowed else [])

    def build_plan(self, meta):
        assert self.reference is not None
        return self.reference.build_plan(meta)

    def forward(self, q, k, v, kv_cache, meta, *, scale, sliding_window=None, logit_cap=None):
        assert self.reference is not None
        return self.reference.forward(q, k, v, kv_cache, meta, scale=scale)


class OtherPagesAttention(PickyAttention):
    layout = PAGES_FIRST


def _ops(names):
    return {op: (lambda *a, op=op, **k: op) for op in names}


def _registry(attention: type[AttentionBackend[Any]] | None):
    class Ref(Backend):
        @classmethod
        def attention_backend(cls, ctx):
            return RefAttention

        def ops(self):
            return _ops(BASE_OPS)

    class Mine(Backend):
        @classmethod
        def attention_backend(cls, ctx):
            return attention

        def ops(self):
            return _ops(["rms_norm"])

    name = (attention.__name__ if attention else "none").lower()
    setattr(impl_module(), f"AttnRef_{name}", Ref)
    setattr(impl_module(), f"AttnMine_{name}", Mine)
    ref = BackendDescriptor(name="ref", impl=f"{impl_module().__name__}:AttnRef_{name}", reference=True)
    mine = BackendDescriptor(name="mine", impl=f"{impl_module().__name__}:AttnMine_{name}", priority=5)
    hooks = {"plinth_register_backends": hookimpl(lambda: [ref, mine])}
    hooks["plinth_register_backends"].__name__ = "plinth_register_backends"
    return registry_of((f"plinth-fake-attention-{name}", "1.0", plugin_module(f"attn_{name}", **hooks)))


def _model(**kw):
    return ModelConfig("X", 10, 8, 1, 2, 1, 4, 64, **kw)


def test_a_backend_without_an_attention_backend_gets_the_reference_one():
    reg = _registry(None)
    ctx = SelectionContext(dtype=torch.float32, page_size=7)
    attention, source = resolve_attention(reg, reg.get("backend", "mine"), ctx, OpTable(_ops(BASE_OPS)))
    assert type(attention) is RefAttention and source == "ref" and attention.reference is None


def test_its_own_is_built_with_the_reference_and_the_op_table():
    reg = _registry(PickyAttention)
    ctx = SelectionContext(dtype=torch.float32, page_size=16)
    ops = OpTable(_ops(BASE_OPS))
    attention, source = resolve_attention(reg, reg.get("backend", "mine"), ctx, ops)
    assert type(attention) is PickyAttention and source == "mine"
    assert type(attention.reference) is RefAttention and attention.ops is ops


def test_sharing_the_reference_pages_in_another_layout_is_refused():
    reg = _registry(OtherPagesAttention)
    with pytest.raises(PluginError, match=r"hands cases to the reference over its own pages \('pages', .*\), but the reference's pages are \('heads', "):
        resolve_attention(reg, reg.get("backend", "mine"), SelectionContext(dtype=torch.float32, page_size=16), OpTable(_ops(BASE_OPS)))


def test_attention_problems_are_the_backends_own_an_explicit_choice_fails_and_auto_moves_on():
    reg = _registry(PickyAttention)
    ok = SelectionContext(dtype=torch.float32, page_size=32, model=_model())
    assert reg.get("backend", "mine").evaluate(ok) == []
    for ctx, why in (
        (SelectionContext(dtype=torch.float32, page_size=48, model=_model()), "page size 48 is not at least 16 and a power of two"),
        (SelectionContext(dtype=torch.bfloat16, page_size=16), "dtype bfloat16 is not one of float32"),
        (SelectionContext(dtype=torch.float32, page_size=16, model=_model(sliding_window=4096)), "sliding windows are not taken"),
    ):
        with pytest.raises(PluginError, match=why):
            reg.select("backend", "mine", ctx)
        assert reg.select("backend", "auto", ctx).name == "ref"


def test_the_plan_is_typed_and_built_once_per_step():
    attention = RefAttention(SelectionContext())
    meta = attention_metadata([(0, 3)], [[0]], 4, torch.device("cpu"))
    assert meta.plan is None
    meta.plan = attention.build_plan(meta)
    first = meta.plan
    attention.plan(meta)  # every layer: the step's plan
    assert meta.plan is first
    meta.plan = AttentionPlan()  # another backend's plan: rebuilt as this one's type
    assert isinstance(attention.plan(meta), CountPlan)


class _TwoLayers(torch.nn.Module):
    def kv_cache_specs(self):
        return [FullAttentionSpec(2, 4), FullAttentionSpec(2, 4)]


@pytest.mark.parametrize("attention_cls", [RefAttention, OtherPagesAttention], ids=["heads_first", "pages_first"])
def test_the_runner_reads_and_writes_whole_pages_through_the_declared_layout(attention_cls):
    ref = RefAttention(SelectionContext())
    attention = attention_cls(SelectionContext(), None, ref)
    cfg = _model()
    runner = ModelRunner(_TwoLayers(), attention, cfg, device=torch.device("cpu"), dtype=torch.float32, num_pages=6, page_size=4)
    k0 = runner.kv_caches[0][0]
    assert tuple(k0.shape) == attention.layout.shape(num_pages=6, page_size=4, num_kv_heads=2, head_dim=4)
    for t in (t for cache in runner.kv_caches for t in cache):
        t.copy_(torch.randn(t.shape))
    saved = runner.read_pages([[1], [4]])
    assert saved.shape == (2, runner.page_bytes())
    want = [t.index_select(attention.layout.page_dim, torch.tensor([1])).clone() for cache in runner.kv_caches for t in cache]
    runner.write_pages([[5], [0]], saved)
    got = [t.index_select(attention.layout.page_dim, torch.tensor([5])) for cache in runner.kv_caches for t in cache]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    runner.copy_pages([[5]], [[2]])  # a fork: the attention backend copies along its page dimension
    assert all(torch.equal(t.index_select(attention.layout.page_dim, torch.tensor([2])), w) for t, w in zip(
        (t for cache in runner.kv_caches for t in cache), want))
