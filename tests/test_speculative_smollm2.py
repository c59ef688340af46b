"""Speculative decoding on the real default model, SmolLM2-135M-Instruct
(GGUF): greedy output with ngram and with a draft model is token for token
the output without speculation, over concurrent requests with preemption
forced. The draft is a tiny random Llama that shares SmolLM2's tokenizer,
rebuilt from the GGUF with the core's tokenizer utilities."""

from __future__ import annotations

import json
import os

import pytest
import torch
from plinth.engine.llm import LLM
from plinth.engine.sampling_params import SamplingParams
from server_fixtures import smollm2_missing

pytestmark = pytest.mark.slow


def tiny_draft_for(gguf: str, vocab: int, path: str) -> str:
    """A 2-layer random Llama with SmolLM2's tokenizer (tokenizer.json from the GGUF)."""
    import transformers
    from plinth.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(gguf)
    os.makedirs(path, exist_ok=True)
    tok.backend.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({**{k: v for k, v in tok.special_tokens.items() if v}, "chat_template": tok.chat_template}, f)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True,
        eos_token_id=list(tok.eos_token_ids), bos_token_id=tok.bos_token_id,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # a loaded 2-core machine: torch's pool spins more than it helps at batch 4
    yield
    torch.set_num_threads(before)


def test_smollm2_greedy_identical_with_ngram_and_a_tiny_draft(tmp_path, one_thread):
    why = smollm2_missing()
    if why:
        pytest.skip(why)
    kw = dict(dtype="float32", backend="torch", load_progress=False, page_size=7, num_pages=24, max_model_len=512)
    base = LLM(**kw)
    tok = base.get_tokenizer()
    passage = "The quick brown fox jumps over the lazy dog. The dog sleeps in the sun by the old red barn."
    convs = [
        [{"role": "user", "content": f"Repeat this text exactly: {passage}"}],
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "user", "content": f"Rewrite in the same words: {passage}"}],
        [{"role": "user", "content": "Count from one to ten in words."}],
    ]
    prompts = [tok.encode(tok.apply_chat_template(c, add_generation_prompt=True), add_special_tokens=False) for c in convs]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in base.generate(prompts, params)]
    assert base.engine.stats()["preemptions"] > 0  # 24 pages of 7 cannot hold all four
    gguf = base.engine.components.source.path
    draft = tiny_draft_for(gguf, base.engine.model_config.vocab_size, str(tmp_path / "draft"))
    del base
    for method, extra in (("ngram", {}), ("draft", {"speculative_model": draft})):
        llm = LLM(speculative_method=method, num_speculative_tokens=4, **extra, **kw)
        llm.engine.spec.cost_model = None  # every proposal scored, whatever the machine's timing (counts below)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert got == want, method
        s = llm.engine.stats()
        assert s["preemptions"] > 0 and s["spec_proposed_tokens"] > 0
        if method == "ngram":  # the repeated passage is copied from the prompt
            assert s["spec_accepted_tokens"] > 10
        del llm
