"""The engine with ``backend="triton"`` (its kernels in Triton's interpreter on
CPU) against ``backend="torch"``: a tiny random Llama-family model (GQA,
q/k norms, head dim 48) and a tiny Qwen3-MoE give the same greedy tokens, in
float32, through chunked prefill over cached prefixes, page size 7, mixed
prefill/decode steps and prefix-cache hits. Also: the op table's sources and
the backend's reasons."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "plugins" / "models" / "llama" / "tests"))

from plinth import LLM, SamplingParams  # noqa: E402
from plinth.api import AcceleratorInfo, SelectionContext  # noqa: E402

PROMPT_LENS = [3, 17, 40]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("triton-e2e"))


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]
    return prompts + [prompts[2][:30] + [5, 6]]  # shares 4 pages of 7 with prompt 3: a prefix-cache hit


def _count_kernel_calls(monkeypatch) -> dict[str, int]:
    """Count the kernels' entry points: the triton run must really take them."""
    from plinth_plugin_triton import attention, moe, norm

    calls = {"decode": 0, "prefill": 0, "fused_moe": 0, "rms_norm": 0}

    def wrap(module, name, key=None):
        real = getattr(module, name)

        def counted(*args, **kwargs):
            k = key(args) if key else name
            calls[k] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)

    wrap(attention, "paged_attention", key=lambda a: "decode" if a[4].decode else "prefill")
    wrap(moe, "fused_moe")
    wrap(norm, "rms_norm")
    return calls


def _greedy_both(path: str, vocab: int) -> tuple[list[list[int]], list[list[int]], LLM]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    out = {}
    for backend in ("torch", "triton"):
        # 24 batched tokens: prompts arrive in chunks after their cached part
        llm = LLM(path, device="cpu", dtype="float32", backend=backend, page_size=7, num_pages=96,
                  max_num_batched_tokens=24, load_progress=False)
        first = llm.generate(_prompts(vocab)[:3], params)
        again = llm.generate(_prompts(vocab)[3:], params)  # after the first batch: its pages are cached
        out[backend] = [o.outputs[0].token_ids for o in first + again]
    return out["torch"], out["triton"], llm


def test_tiny_llama_same_greedy_tokens(root, monkeypatch):
    from tiny_models import VOCAB, tiny_model_dir

    calls = _count_kernel_calls(monkeypatch)
    torch_tokens, triton_tokens, llm = _greedy_both(tiny_model_dir("qwen3", root), VOCAB)
    assert calls["decode"] > 0 and calls["prefill"] > 0 and calls["rms_norm"] > 0, calls
    assert all(len(t) == NEW_TOKENS for t in triton_tokens)
    assert triton_tokens == torch_tokens


def test_tiny_moe_same_greedy_tokens(root, monkeypatch):
    from tiny_models import write_tokenizer
    from tiny_moe import VOCAB, saved_model

    path = saved_model("qwen3moe", root)
    write_tokenizer(path)  # the engine wants one; prompts are token ids anyway
    calls = _count_kernel_calls(monkeypatch)
    torch_tokens, triton_tokens, _ = _greedy_both(path, VOCAB)
    assert calls["decode"] > 0 and calls["prefill"] > 0 and calls["fused_moe"] > 0, calls
    assert all(len(t) == NEW_TOKENS for t in triton_tokens)
    assert triton_tokens == torch_tokens


# ---- the backend as start-up sees it ----------------------------------------------------


class FakeAccelerator:
    """What check() and fp8_path read: device_type and info()."""

    def __init__(self, device_type: str, **info):
        self.device_type = device_type
        self._info = AcceleratorInfo(device_type=device_type, dist_backend="nccl", device_count=1, **info)

    def info(self):
        return self._info


def test_check_reasons(monkeypatch):
    from plinth_plugin_triton.backend import TritonBackend

    assert TritonBackend.check(SelectionContext(accelerator=FakeAccelerator("cpu"), dtype=torch.float32)) == []  # interpreter on
    monkeypatch.delenv("TRITON_INTERPRET")
    reasons = TritonBackend.check(SelectionContext(accelerator=FakeAccelerator("cpu"), dtype=torch.float32))
    assert len(reasons) == 1 and "CUDA" in reasons[0] and "TRITON_INTERPRET=1" in reasons[0]
    old_gpu = FakeAccelerator("cuda", device_name="Tesla V100", capability="sm_70", fp8="weight_only", dtypes=("float16", "float32"))
    reasons = TritonBackend.check(SelectionContext(accelerator=old_gpu, dtype=torch.bfloat16))
    assert len(reasons) == 1 and "bfloat16" in reasons[0] and "sm_70" in reasons[0]
    assert any("dtype torch.int8" in r for r in TritonBackend.check(SelectionContext(dtype=torch.int8)))
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    assert any("triton is not installed" in r for r in TritonBackend.check(SelectionContext()))


def test_fp8_path_from_the_accelerator():
    from plinth_plugin_triton.backend import fp8_path

    h200 = FakeAccelerator("cuda", device_name="NVIDIA H200", capability="sm_90", fp8="native")
    a100 = FakeAccelerator("cuda", device_name="NVIDIA A100", capability="sm_80", fp8="weight_only")
    path, why = fp8_path(SelectionContext(accelerator=h200))
    assert path == "w8a8" and "sm_90" in why and "128x128" in why
    path, why = fp8_path(SelectionContext(accelerator=a100))
    assert path == "weight_only_bits" and "sm_89" in why and "sm_80" in why  # no float8 pointer in Triton below sm_89
    path, why = fp8_path(SelectionContext(accelerator=FakeAccelerator("cpu", fp8="weight_only")))
    assert path == "weight_only" and "interpreter" in why


def test_op_sources_declared_per_op():
    """Start-up's merge: the kernels' ops from triton, the rest from torch, as
    declared; attention from its own attention backend."""
    from plinth.api import load_accelerator
    from plinth.testing import resolve_attention_backend, resolve_op_table
    from plinth_plugin_triton.attention import TritonAttention
    from plinth_plugin_triton.backend import FROM_REFERENCE

    ctx = SelectionContext(accelerator=load_accelerator("cpu"), dtype=torch.float32)
    ops, sources = resolve_op_table("triton", ctx)
    for op in ("fused_moe", "rms_norm", "linear", "pack_linear"):
        assert sources[op] == "triton", op
    for op in ("rotary", "silu_and_mul"):
        assert sources[op] == "torch" and op in FROM_REFERENCE
    attention, source = resolve_attention_backend("triton", ctx, ops)
    assert type(attention) is TritonAttention and source == "triton"
    assert ops.capabilities.fp8 == "weight_only" and "fp8_path" not in ops.names()
