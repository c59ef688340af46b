"""Tiny random Gemma 3 text models built with transformers (the reference),
saved as safetensors beside a small byte-level tokenizer, and the references'
logits and greedy tokens."""

from __future__ import annotations

import functools
import json
import os

import torch

VOCAB = 300

#: window 8-16 tokens, one global layer in three, prompts longer than the window
CONFIGS = {
    # q/k/v heads 4/2, head_dim 32 (not hidden / heads), scores scaled by
    # query_pre_attn_scalar 24 (not head_dim), linear rope scaling on the
    # global layers, tied head
    "gemma3": dict(
        sliding_window=8, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
    ),
    # final logit soft-capping (the attention cap transformers ignores, as we do), an untied head, window 13
    "gemma3-softcap": dict(
        sliding_window=13, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        attn_logit_softcapping=20.0, final_logit_softcapping=15.0, tie_word_embeddings=False,
    ),
}


def tiny_config(name: str):
    from transformers import Gemma3TextConfig

    extra = dict(CONFIGS[name])
    layers = len(extra["layer_types"])
    return Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24,
        max_position_embeddings=512, rms_norm_eps=1e-6,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
        **{"tie_word_embeddings": True, **extra},
    )


def write_tokenizer(path: str) -> None:
    """A byte-level BPE over all 256 bytes: any text encodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>", "<start_of_turn>", "<end_of_turn>"])
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<eos>", "bos_token": None, "tokenizer_class": "PreTrainedTokenizerFast"}, f)


@functools.cache
def saved_model(name: str, root: str) -> str:
    from transformers import AutoModelForCausalLM

    path = os.path.join(root, name)
    torch.manual_seed(sum(map(ord, name)))
    model = AutoModelForCausalLM.from_config(tiny_config(name), dtype=torch.float32)
    with torch.no_grad():  # larger than the default init: logits far from flat, no greedy near-ties
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            else:  # norms (zeros at init: 1 + weight): perturbed, so the +1 is checked
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path)
    return path


@functools.cache
def reference(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def reference_logits(path: str, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return reference(path)(torch.tensor([prompt])).logits[0].float()


@functools.cache
def reference_greedy(path: str, prompt: tuple[int, ...], new_tokens: int) -> list[int]:
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = reference(path).generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=False, pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()


def prompts(lens: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lens]
