"""Tiny random DeepSeek-V3 models built with transformers (float32, 2 dense
then 2 MoE layers, 8 routed experts in n_group 4 / topk_group 2, a shared
expert, yarn rope with mscale), saved as safetensors (``plinth.testing``'s
``save_random_model``), and their references."""

from __future__ import annotations

import functools
import json
import os

import torch
from plinth.testing import random_prompts, save_random_model
from plinth.testing import reference_greedy as greedy
from plinth.testing import reference_model as reference  # noqa: F401 (the tests' name for it)

VOCAB = 320
PROMPT_LENS = [3, 17, 40, 64, 101]
VARIANTS = ["q_lora", "no_q_lora"]  # and "experts6" (tiny_config)


def tiny_config(name: str, vocab_size: int = VOCAB):
    """``q_lora`` / ``no_q_lora``: the models above; ``experts6``: 6 routed
    experts in n_group 3 / topk_group 2 and 3 layers (1 dense), for ep = 4
    (which does not divide 6); ``kimi``: q_lora's shape with Kimi K2's
    tokenizer (tiny_kimi.py) and a vocabulary to match."""
    from transformers import DeepseekV3Config

    shape = dict(num_hidden_layers=4, first_k_dense_replace=2, n_routed_experts=8, n_group=4)
    if name == "experts6":
        shape = dict(num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=6, n_group=3)
    return DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, **shape,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, num_experts_per_tok=2, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
        q_lora_rank=24 if name in ("q_lora", "kimi") else None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
        v_head_dim=12, max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "mscale": 1.0,
                      "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0},
    )


def _router_bias(model) -> None:
    for n, b in model.named_buffers():
        if n.endswith("e_score_correction_bias"):  # a bias that changes which experts win
            b.copy_(torch.randn_like(b) * 0.1)


@functools.cache
def saved_model(name: str, root: str) -> str:
    path = os.path.join(root, name)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    if name == "kimi":
        from tiny_kimi import write_kimi_tokenizer

        config = tiny_config(name, vocab_size=len(write_kimi_tokenizer(path)) + 256)
    else:
        config = tiny_config(name)
    save_random_model(config, path, seed=sum(map(ord, name)), adjust=_router_bias)
    if name != "kimi":
        write_tokenizer(path)
    return path


DEEPSEEK_CHAT_TEMPLATE = (
    "{{ bos_token }}{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}{{ m['content'] }}"
    "{%- elif m['role'] == 'user' -%}<｜User｜>{{ m['content'] }}"
    "{%- elif m['role'] == 'assistant' -%}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<｜Assistant｜>{%- endif -%}"
)


def write_tokenizer(path: str) -> None:
    """A byte-level BPE over all 256 bytes plus DeepSeek's specials and a
    DeepSeek-V3-style chat template (its markers, not its whole text), so
    the engine loads and serves the folder like any checkpoint."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"])
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>", "tokenizer_class": "PreTrainedTokenizerFast",
                   "chat_template": DEEPSEEK_CHAT_TEMPLATE}, f)


def prompts() -> list[list[int]]:
    return random_prompts(VOCAB, PROMPT_LENS)


@functools.cache
def reference_greedy(path: str, new_tokens: int) -> list[list[int]]:
    return greedy(path, prompts(), new_tokens)
