"""The engine with ``backend="dlinfer"`` on the fake dlinfer and the fake NPU
against ``backend="torch"`` on the same device: a tiny random Qwen3 (GQA,
q/k norms, head dim 48) and a tiny Qwen3-MoE give the same greedy tokens in
float16, at page sizes 16 and 32 (the vendor's kernels take powers of two
>= 16), through prefills without a cache, chunked prefills after a cached
prefix, mixed and decode-only steps and prefix-cache hits. Every kind of
dlinfer attention call must be taken."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "plugins" / "models" / "llama" / "tests"))

from plinth import LLM, SamplingParams  # noqa: E402
from tiny_models import assert_greedy_equal_up_to_near_ties  # noqa: E402

PROMPT_LENS = [3, 17, 40]
NEW_TOKENS = 10
#: float16 logprobs of the tiny models through two orders of sums: two tokens
#: closer than this may swap, and every token before that must be within half of it
FP16_TIE = 0.04


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("dlinfer-e2e"))


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]
    return prompts + [prompts[2][:36] + [5, 6]]  # shares two 16-token pages with prompt 3: a prefix-cache hit


def _count_dlinfer_calls(monkeypatch) -> dict[str, int]:
    """Count the vendor ops dlinfer.ops dispatches to: the run must take them."""
    from dlinfer.vendor import vendor_ops_registry

    calls = {name: 0 for name in vendor_ops_registry}
    for name, real in list(vendor_ops_registry.items()):

        def counted(*args, _name=name, _real=real, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setitem(vendor_ops_registry, name, counted)
    return calls


def _greedy(path: str, vocab: int, backend: str, page_size: int, registry) -> tuple[list[list[int]], list[list]]:
    """Greedy tokens and, for each, the top 2 logprobs (near-ties: see assert_greedy_equal_up_to_near_ties)."""
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=2)
    # 24 batched tokens: long prompts arrive in chunks after their cached part
    llm = LLM(path, device="fakenpu", dtype="float16", backend=backend, page_size=page_size, num_pages=64,
              max_num_batched_tokens=24, load_progress=False, registry=registry)
    first = llm.generate(_prompts(vocab)[:3], params)
    again = llm.generate(_prompts(vocab)[3:], params)  # after the first batch: its pages are cached
    return [o.outputs[0].token_ids for o in first + again], [o.outputs[0].logprobs for o in first + again]


def _check_same(path, vocab, page_size, registry, monkeypatch, moe: bool) -> None:
    want, want_logprobs = _greedy(path, vocab, "torch", page_size, registry)
    calls = _count_dlinfer_calls(monkeypatch)
    got, got_logprobs = _greedy(path, vocab, "dlinfer", page_size, registry)
    for op in ("fill_kv_cache", "prefill_attention", "paged_prefill_attention", "paged_decode_attention",
               "add_rms_norm", "rms_norm", "apply_rotary_pos_emb", "linear"):
        assert calls[op] > 0, (op, calls)
    assert (calls["fused_moe"] > 0) == moe and (calls["silu_and_mul"] > 0) != moe, calls
    assert all(len(t) == NEW_TOKENS for t in got)
    # float16 through another order of sums (the vendor's kernels): equal but at near-ties
    assert_greedy_equal_up_to_near_ties(got, want, want_logprobs, margin=FP16_TIE, got_logprobs=got_logprobs)


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [16, 32])
def test_tiny_qwen3_same_greedy_tokens(root, fake_npu, monkeypatch, page_size):
    from tiny_models import VOCAB, tiny_model_dir

    _check_same(tiny_model_dir("qwen3", root), VOCAB, page_size, fake_npu, monkeypatch, moe=False)


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [16, 32])
def test_tiny_qwen3_moe_same_greedy_tokens(root, fake_npu, monkeypatch, page_size):
    from tiny_models import write_tokenizer
    from tiny_moe import VOCAB, saved_model

    path = saved_model("qwen3moe", root)
    write_tokenizer(path)  # the engine wants one; prompts are token ids anyway
    _check_same(path, VOCAB, page_size, fake_npu, monkeypatch, moe=True)
