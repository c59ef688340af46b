"""Tiny random mixture-of-experts models built with transformers (float32),
saved as safetensors with per-expert weights (``plinth.testing``'s
``save_random_model``), and greedy references."""

from __future__ import annotations

import functools
import os

from plinth.testing import random_prompts, save_random_model
from plinth.testing import reference_greedy as greedy
from plinth.testing import reference_model as reference  # noqa: F401 (the tests' name for it)

VOCAB = 256
PROMPT_LENS = [3, 17, 40, 64, 101]


def tiny_config(name: str):
    import transformers

    common = dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    if name == "qwen3moe":  # q/k norms, top-k weights renormalized, 8 experts top 2
        return transformers.Qwen3MoeConfig(
            **common, head_dim=24, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
            num_experts_per_tok=2, norm_topk_prob=True,
        )
    if name == "qwen3moe5":  # 5 experts: an ep group of 2 splits them 3 + 2
        return transformers.Qwen3MoeConfig(
            **common, head_dim=24, intermediate_size=96, moe_intermediate_size=32, num_experts=5,
            num_experts_per_tok=2, norm_topk_prob=True,
        )
    if name == "qwen2moe":  # q/k/v biases, shared expert with its sigmoid gate, raw top-k weights, a dense layer
        return transformers.Qwen2MoeConfig(
            **common, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            num_experts=8, num_experts_per_tok=3, norm_topk_prob=False, mlp_only_layers=[1],
        )
    if name == "mixtral":  # always renormalized, 4 experts top 2
        return transformers.MixtralConfig(**common, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)
    raise ValueError(name)


@functools.cache
def saved_model(name: str, root: str) -> str:
    return save_random_model(tiny_config(name), os.path.join(root, name), seed=sum(map(ord, name)))


def prompts() -> list[list[int]]:
    return random_prompts(VOCAB, PROMPT_LENS)


@functools.cache
def reference_greedy(path: str, new_tokens: int) -> list[list[int]]:
    return greedy(path, prompts(), new_tokens)
