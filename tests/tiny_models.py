"""Tiny random-weight Hugging Face models for tests, built with transformers
(the reference implementation) and saved as safetensors with a small
byte-level BPE tokenizer, so that plinth loads them like any model folder."""

from __future__ import annotations

import json
import os
import zlib
from functools import cache

VOCAB = 300  # 256 byte tokens, specials, a few merges
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tokenizer(path: str) -> None:
    """A byte-level BPE over all 256 bytes plus specials: any text encodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("a", "n")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    assert tok.get_vocab_size() <= VOCAB
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "eos_token": "<|im_end|>",
                "bos_token": None,
                "chat_template": CHAT_TEMPLATE,
                "tokenizer_class": "PreTrainedTokenizerFast",
            },
            f,
        )


def tiny_config(arch: str):
    import transformers

    common = dict(
        vocab_size=VOCAB,
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        eos_token_id=263,  # <|im_end|>
        bos_token_id=None,
    )
    if arch == "llama":
        return transformers.LlamaConfig(**common, rope_theta=10000.0)
    if arch == "llama3-rope":  # llama 3 rope scaling, tied embeddings, head_dim 40 (not a power of two)
        cfg = dict(common, hidden_size=160, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True)
        return transformers.LlamaConfig(
            **cfg,
            rope_parameters={
                "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 128,
            },
        )
    if arch == "qwen2":  # q/k/v biases
        return transformers.Qwen2Config(**common)
    if arch == "qwen3":  # per-head q/k norms; head_dim 48 set explicitly (not hidden / heads)
        return transformers.Qwen3Config(**common, head_dim=48)
    if arch == "mistral":  # sliding window smaller than the prompts
        return transformers.MistralConfig(**common, sliding_window=24)
    if arch == "qwen3-hybrid":  # half the layers sliding-window (two KV-cache groups), a window of 12
        cfg = dict(common, num_hidden_layers=4)
        layer_types = ["sliding_attention", "full_attention"] * 2
        return transformers.Qwen3Config(**cfg, head_dim=24, sliding_window=12, use_sliding_window=True, layer_types=layer_types)
    raise ValueError(arch)


@cache
def tiny_model_dir(arch: str, root: str) -> str:
    """Build (once per process) and save the tiny model of ``arch`` under root."""
    import torch
    from transformers import AutoModelForCausalLM

    path = os.path.join(root, arch)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    os.makedirs(path, exist_ok=True)
    # a stable seed: hash() of a str changes with every process (PYTHONHASHSEED),
    # which made each run test other random weights
    torch.manual_seed(zlib.crc32(arch.encode()) % 1000)
    model = AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32)
    with torch.no_grad():  # larger weights than the default init: logits far from flat
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path)
    return path


@cache
def reference_model(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def reference_greedy(path: str, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation, ignoring EOS (an explicit loop over
    its forward with its KV cache: generate() would ban EOS under
    min_new_tokens and treat pad-id tokens in the prompt as padding)."""
    import torch

    model = reference_model(path)
    out: list[int] = []
    with torch.no_grad():
        res = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(n):
            token = int(res.logits[0, -1].argmax())
            out.append(token)
            res = model(torch.tensor([[token]]), cache=res.past_key_values, use_cache=True)
    return out


def reference_logprobs(path: str, tokens: list[int]):
    """log_softmax of the reference logits at every position of ``tokens``."""
    import torch

    model = reference_model(path)
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits, -1)


def assert_greedy_equal_up_to_near_ties(
    got: list[list[int]], want: list[list[int]], want_logprobs: list[list], *, margin: float, got_logprobs: list[list] | None = None
) -> None:
    """``got`` gives ``want``'s greedy tokens, except that a sequence may part
    from ``want`` where ``want``'s two most likely tokens were within
    ``margin`` (logprob) and ``got`` took the other one of them; it is not
    compared after that. Two correct paths that add in another order
    (another kernel, a sum over ranks) round differently, and a near-tie is
    where that shows: on one CPU the paths agree, on another (seen: AMD EPYC
    against an Intel Xeon with AMX and AVX512-FP16) a token parts. A parting
    anywhere else fails. With ``got_logprobs``, every token before a parting
    must also have ``want``'s logprob within ``margin / 2``: the two paths
    agree in their numbers, not only in their argmax. Logprobs: a run's
    ``outputs[0].logprobs`` with at least the top 2 (``SamplingParams(logprobs=2)``)."""
    assert len(got) == len(want) == len(want_logprobs)
    for n, (g, w, lps) in enumerate(zip(got, want, want_logprobs)):
        assert len(g) == len(w), f"sequence {n}: {len(g)} tokens, want {len(w)}"
        parted = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(g))
        if got_logprobs is not None:
            for i in range(parted):
                diff = abs(got_logprobs[n][i].logprob - lps[i].logprob)
                assert diff <= margin / 2, f"sequence {n}, token {i} ({g[i]}): logprob {got_logprobs[n][i].logprob:.4f}, want {lps[i].logprob:.4f}"
        if parted == len(g):
            continue
        top = lps[parted].top
        assert len(top) >= 2, "the reference run needs SamplingParams(logprobs=2)"
        first, second = sorted(top, key=lambda lp: -lp.logprob)[:2]
        gap = first.logprob - second.logprob
        assert {w[parted], g[parted]} == {first.token_id, second.token_id} and gap <= margin, (
            f"sequence {n} parts at token {parted}: got {g[parted]}, want {w[parted]}, and that is no near-tie "
            f"(want's top two: {first.token_id} {first.logprob:.4f}, {second.token_id} {second.logprob:.4f}; margin {margin})\n"
            f"got  {g}\nwant {w}"
        )
