"""The op table is open and typed: a backend may bring an op the core does
not list, a model loader names the ops it needs, and start-up fails naming
the missing op and the backends tried."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
from plinth.api import (
    BASE_OPS,
    OP_NAMES,
    OP_SIGNATURES,
    Backend,
    BackendDescriptor,
    ModelConfig,
    ModelLoader,
    SelectionContext,
    hookimpl,
)
from plinth.engine.startup import check_required_ops, resolve_ops
from plinth.errors import PluginError
from plugin_fakes import impl_module, plugin_module, registry_of


def _backend(name: str, ops: dict[str, Any]) -> str:
    class Fake(Backend):
        def ops(self):
            return dict(ops)

    attr = f"Backend_{name}"
    Fake.__name__ = attr
    setattr(impl_module(), attr, Fake)
    return f"{impl_module().__name__}:{attr}"


def _registry(ref_ops: dict[str, Any], mine: dict[str, Any]):
    ref = BackendDescriptor(name="ref", impl=_backend("ref", ref_ops), reference=True)
    fast = BackendDescriptor(name="fast", impl=_backend("fast", mine), priority=5)
    hooks = {"plinth_register_backends": hookimpl(lambda: [ref, fast])}
    hooks["plinth_register_backends"].__name__ = "plinth_register_backends"
    return registry_of(("plinth-fake-backends", "1.0", plugin_module("backends", **hooks)))


def test_every_core_op_has_a_typed_signature():
    assert set(OP_NAMES) == set(OP_SIGNATURES) and set(BASE_OPS) <= set(OP_NAMES)
    for name, proto in OP_SIGNATURES.items():
        sig = inspect.signature(proto.__call__)
        assert "self" in sig.parameters and sig.return_annotation is not inspect.Signature.empty, name
    moe = inspect.signature(OP_SIGNATURES["fused_moe"].__call__)
    assert list(moe.parameters)[1:] == ["x", "w13", "w2", "topk_weights", "topk_ids"]


def test_a_backend_may_bring_an_op_the_core_does_not_list():
    reg = _registry({op: (lambda *a, op=op: op) for op in BASE_OPS}, {"my_mla_attention": lambda: "mla", "linear": lambda: "fast", "pack_linear": lambda: "fast"})
    ops, sources = resolve_ops(reg, reg.get("backend", "fast"), SelectionContext())
    assert ops.my_mla_attention() == "mla" and sources["my_mla_attention"] == "fast"
    assert ops.linear() == "fast" and ops.rms_norm() == "rms_norm" and sources["rms_norm"] == "ref"
    check_required_ops([*BASE_OPS, "my_mla_attention"], ops, ["fast", "ref"], "FakeForCausalLM")


def test_a_model_needing_an_op_no_backend_provides_fails_naming_it_and_the_backends():
    reg = _registry({op: (lambda: None) for op in BASE_OPS}, {})
    ops, _ = resolve_ops(reg, reg.get("backend", "fast"), SelectionContext())

    class MoELoader(ModelLoader):
        pass

    cfg = ModelConfig("Qwen3MoeForCausalLM", 10, 8, 1, 2, 1, 4, 64, num_experts=4)
    needed = MoELoader().required_ops(cfg)
    assert "fused_moe" in needed
    with pytest.raises(PluginError) as err:
        check_required_ops(needed, ops, ["fast", "ref"], cfg.architecture)
    msg = str(err.value)
    assert "Qwen3MoeForCausalLM needs op fused_moe" in msg and "tried: fast, ref" in msg
    dense = ModelConfig("LlamaForCausalLM", 10, 8, 1, 2, 1, 4, 64)
    check_required_ops(MoELoader().required_ops(dense), ops, ["fast", "ref"], dense.architecture)
