"""The engine with ``--a2a deepep`` on spawned ranks over gloo, through the
faithful fake ``deep_ep`` (plugins/a2a/deepep/tests/fake: every upstream
assert quoted): ep 2 (dp 2) on a tiny Qwen3-MoE with a hidden size the
low-latency kernels take (2048), each rank prefilling a 600-token prompt in
one step and decoding on the low-latency kernels (legacy) or V2's buffer
sized for the step budget, gives one process's greedy tokens.

The model runs in bfloat16, DeepEP's wire dtype, on both sides: a float32
model would meet bf16 rounding on the wire that one process never sees.
deepep's check() refuses a CPU device (DeepEP runs on CUDA); the launcher
here judges the plan with "cpu" allowed, which is all the fake changes."""

from __future__ import annotations

import functools
import os
import pathlib
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
FAKE = str(ROOT / "plugins/a2a/deepep/tests/fake")
sys.path.insert(0, str(ROOT / "plugins/a2a/deepep/tests"))
import fake_nccl  # noqa: E402  (a scripted host: NCCL 2.30.4 mapped for real, an RDMA device, IBGDA)

VOCAB = 256
KW = dict(device="cpu", backend="torch", dtype="bfloat16", num_pages=160, load_progress=False, max_num_seqs=8,
          max_num_batched_tokens=640, max_model_len=1024)  # fmt: skip
NEW = 8

pytestmark = pytest.mark.slow  # a 2048-wide model and the fake's token-by-token movement


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    import transformers
    from tiny_models import write_tokenizer

    path = str(tmp_path_factory.mktemp("deepep") / "qwen3moe-2048")
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=2048, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
        intermediate_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
        pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(2048)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # logits far from flat: no greedy near-ties for bf16 on the wire to flip
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path)
    return path


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (600, 600, 5, 31)]


#: bf16 logits through another order of sums (the experts' outputs combined
#: over ranks, in bf16 on the wire) moved logprobs by up to 0.061 (seen on an
#: Intel Xeon with AMX: a top two 0.125 apart swapped); two tokens closer than
#: this may swap, and every token before that must be within half of it
BF16_TIE = 0.16


@functools.cache
def single(path: str) -> tuple[list[list[int]], list[list]]:
    """One process's greedy tokens and their top-2 logprobs."""
    from plinth import LLM, SamplingParams

    llm = LLM(path, **KW)
    outs = llm.generate(prompts(), [SamplingParams(max_tokens=NEW, temperature=0, logprobs=2)] * 4)
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs]


@pytest.mark.parametrize("generation", ["legacy", "v2"])
def test_engine_with_deepep_matches_one_process(model_dir, generation, monkeypatch):
    from plinth import LLM, SamplingParams
    from plinth_plugin_deepep import a2a as deepep_a2a
    from tiny_models import assert_greedy_equal_up_to_near_ties

    want, want_logprobs = single(model_dir)
    monkeypatch.syspath_prepend(FAKE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([FAKE, os.environ.get("PYTHONPATH", "")]))  # the spawned rank
    fake_nccl.use(monkeypatch, fake_nccl.scripted_host())  # the spawned rank too (LD_PRELOAD)
    monkeypatch.setattr(deepep_a2a, "DEVICE_TYPES", ("cuda", "cpu"))  # the launcher's check: the fake runs on CPU
    llm = LLM(model_dir, ep=2, a2a="deepep", plugin_options={"deepep_generation": generation}, **KW)
    try:
        outs = llm.generate(prompts(), [SamplingParams(max_tokens=NEW, temperature=0, logprobs=2)] * 4)
        got = [o.outputs[0].token_ids for o in outs]
        import deep_ep

        assert deep_ep.__file__.startswith(FAKE)
        names = [name for name, _ in deep_ep.CALLS]
    finally:
        llm.close()
    assert_greedy_equal_up_to_near_ties(got, want, want_logprobs, margin=BF16_TIE, got_logprobs=[o.outputs[0].logprobs for o in outs])
    if generation == "legacy":  # rank 0's calls: one Buffer, prefill on the normal kernels, decode on the low-latency ones
        assert names.count("Buffer") == 1
        prefill = [kw["tokens"] for name, kw in deep_ep.CALLS if name == "dispatch"]
        assert max(prefill) >= 600
        assert names.count("low_latency_dispatch") >= 2 * (NEW - 1) and "clean_low_latency_buffer" in names
    else:
        assert [kw for name, kw in deep_ep.CALLS if name == "ElasticBuffer"][0]["num_max_tokens_per_rank"] == 640
        assert max(kw["tokens"] for name, kw in deep_ep.CALLS if name == "elastic_dispatch") >= 600
        # decode steps dispatch without a host sync, bounded by max_num_seqs (elastic.py:961)
        assert any(not kw["cpu_sync"] and kw["num_max"] == 8 for name, kw in deep_ep.CALLS if name == "elastic_dispatch")
    deep_ep.CALLS.clear()
