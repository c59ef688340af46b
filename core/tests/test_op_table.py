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
    Accelerator,
    AcceleratorDescriptor,
    Backend,
    BackendCapabilities,
    BackendDescriptor,
    ModelConfig,
    ModelLoader,
    OpTable,
    SelectionContext,
    hookimpl,
    missing_methods,
    op_signature_problems,
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


def _any_ops(names, result=None) -> dict[str, Any]:
    """Ops that take any arguments (so match every signature) and return
    ``result``, or their own name."""
    return {op: (lambda *a, op=op, **k: op if result is None else result) for op in names}


def test_every_core_op_has_a_typed_signature():
    assert set(OP_NAMES) == set(OP_SIGNATURES) and set(BASE_OPS) <= set(OP_NAMES)
    for name, proto in OP_SIGNATURES.items():
        sig = inspect.signature(proto.__call__)
        assert "self" in sig.parameters and sig.return_annotation is not inspect.Signature.empty, name
    moe = inspect.signature(OP_SIGNATURES["fused_moe"].__call__)
    assert list(moe.parameters)[1:] == ["x", "w13", "w2", "topk_weights", "topk_ids"]


def test_a_backend_may_bring_an_op_the_core_does_not_list():
    reg = _registry(_any_ops(BASE_OPS), {"my_mla_attention": lambda: "mla", **_any_ops(["linear", "pack_linear"], "fast")})
    ops, sources = resolve_ops(reg, reg.get("backend", "fast"), SelectionContext())
    assert ops.my_mla_attention() == "mla" and sources["my_mla_attention"] == "fast"
    assert ops.linear() == "fast" and ops.rms_norm() == "rms_norm" and sources["rms_norm"] == "ref"
    check_required_ops([*BASE_OPS, "my_mla_attention"], ops, ["fast", "ref"], "FakeForCausalLM")


def test_a_model_needing_an_op_no_backend_provides_fails_naming_it_and_the_backends():
    reg = _registry(_any_ops(BASE_OPS), {})
    ops, _ = resolve_ops(reg, reg.get("backend", "fast"), SelectionContext())

    class MoELoader(ModelLoader):
        def load_config(self, source):
            raise AssertionError("not loaded here")

        load_tokenizer = load_model = load_config

    cfg = ModelConfig("Qwen3MoeForCausalLM", 10, 8, 1, 2, 1, 4, 64, num_experts=4)
    needed = MoELoader().required_ops(cfg)
    assert "fused_moe" in needed
    with pytest.raises(PluginError) as err:
        check_required_ops(needed, ops, ["fast", "ref"], cfg.architecture)
    msg = str(err.value)
    assert "Qwen3MoeForCausalLM needs op fused_moe" in msg and "tried: fast, ref" in msg
    dense = ModelConfig("LlamaForCausalLM", 10, 8, 1, 2, 1, 4, 64)
    check_required_ops(MoELoader().required_ops(dense), ops, ["fast", "ref"], dense.architecture)


def test_an_op_with_a_wrong_signature_is_refused_at_resolve_naming_it_and_the_backend():
    def linear(x, w):  # no bias: a model passing one would fail mid-forward
        return x

    def rms_norm(x, weight, eps, *, residual=None):  # residual is positional in the contract
        return x

    reg = _registry(_any_ops(BASE_OPS), {"linear": linear, "rms_norm": rms_norm, "pack_linear": lambda weight: weight})
    with pytest.raises(PluginError) as err:
        resolve_ops(reg, reg.get("backend", "fast"), SelectionContext())
    msg = str(err.value)
    assert msg.startswith("backend fast (plinth-fake-backends 1.0): op linear(x, w) does not match LinearOp")
    assert "takes no positional parameter 3 (bias)" in msg and "op rms_norm" in msg and "pack_linear" not in msg


def test_signature_rules_follow_the_protocol():
    ok = [
        ("linear", lambda x, weight, bias=None, *, extra=0: x),  # an extra parameter with a default is fine
        ("linear", lambda *args, **kwargs: None),
        ("fused_moe", lambda x, w13, w2, topk_weights, topk_ids: x),
        ("my_own_op", lambda whatever: whatever),  # a backend's own op: only callable
    ]
    for name, fn in ok:
        assert op_signature_problems(name, fn) == [], name
    bad = [
        ("linear", lambda x, weight, bias: x, "requires bias, which callers may omit"),
        ("linear", lambda x, w, bias=None: x, "names parameter 2 'w', not 'weight'"),
        ("rotary", lambda q, k, positions, cos_sin: q, "takes no positional parameter 5 (is_neox)"),
        ("fused_moe", lambda x, w13, w2, topk_weights, topk_ids, stream: x, "requires stream, which callers never pass"),
        ("rotary", "not callable", "is a str, not a callable"),
    ]
    for name, fn, why in bad:
        problems = op_signature_problems(name, fn)
        assert len(problems) == 1 and why in problems[0], (name, problems)


def test_a_declined_op_must_not_be_returned():
    class Declining(Backend):
        @classmethod
        def unsupported_ops(cls, ctx):
            return {"linear": "no GEMM for this dtype"}

        def ops(self):
            return _any_ops(["linear"])

    impl_module().Backend_declining = Declining
    ref = BackendDescriptor(name="ref", impl=_backend("ref2", _any_ops(BASE_OPS)), reference=True)
    mine = BackendDescriptor(name="declining", impl=f"{impl_module().__name__}:Backend_declining")
    hooks = {"plinth_register_backends": hookimpl(lambda: [ref, mine])}
    hooks["plinth_register_backends"].__name__ = "plinth_register_backends"
    reg = registry_of(("plinth-fake-backends", "1.0", plugin_module("declining", **hooks)))
    with pytest.raises(PluginError, match="declines linear in unsupported_ops\\(\\) yet returns it from ops\\(\\)"):
        resolve_ops(reg, reg.get("backend", "declining"), SelectionContext())


def test_the_table_is_plain_attributes_with_declared_capabilities():
    table = OpTable(_any_ops(BASE_OPS), BackendCapabilities(gguf_formats=("Q8_0",), gguf_path="test"))
    assert table.linear is vars(table)["linear"]  # an instance attribute: no lookup per call
    assert table.fused_moe is None
    assert set(table.names()) == set(BASE_OPS) and table.capabilities.gguf_formats == ("Q8_0",)
    with pytest.raises(TypeError, match="op name 'capabilities' is reserved"):
        OpTable({"capabilities": lambda: None})


def test_a_plugin_class_missing_a_required_method_fails_at_load_naming_it():
    class HalfBackend(Backend):  # ops() is required
        pass

    class HalfAccelerator(Accelerator):  # info() and memory() are required
        def info(self):
            raise AssertionError("never called")

    impl_module().HalfBackend = HalfBackend
    impl_module().HalfAccelerator = HalfAccelerator
    assert missing_methods(HalfAccelerator) == ["memory"]
    backends = {"plinth_register_backends": hookimpl(lambda: [BackendDescriptor(name="half", impl=f"{impl_module().__name__}:HalfBackend")])}
    backends["plinth_register_backends"].__name__ = "plinth_register_backends"
    reg = registry_of(
        ("plinth-half-backend", "1.0", plugin_module("halfbackend", **backends)),
        ("plinth-half-accel", "1.0", plugin_module("halfaccel", AcceleratorDescriptor(name="half", impl=f"{impl_module().__name__}:HalfAccelerator"))),
    )
    with pytest.raises(PluginError) as err:
        reg.get("backend", "half").load()
    assert "HalfBackend does not implement ops (required by plinth.api.Backend)" in str(err.value)
    entry = reg.get("accelerator", "half")
    assert entry.evaluate(SelectionContext()) == [f"{impl_module().__name__}:HalfAccelerator does not implement memory (required by plinth.api.Accelerator)"]
    assert entry.status == "failed"


def test_a_backend_returning_an_attention_op_of_plugin_api_1_is_refused_with_a_pointer():
    """Since plugin API 2.0 attention and the KV layout are the AttentionBackend's:
    a 1.x backend's ops() with them fails naming the op and where it went."""
    reg = _registry(_any_ops(BASE_OPS), _any_ops(["allocate_kv_cache", "linear", "pack_linear"]))
    with pytest.raises(PluginError, match="op allocate_kv_cache is no compute op since plugin API 2.0: .*AttentionBackend"):
        resolve_ops(reg, reg.get("backend", "fast"), SelectionContext())
    with pytest.raises(TypeError, match="op qkv_attention is no compute op"):
        OpTable(_any_ops(["qkv_attention"]))
