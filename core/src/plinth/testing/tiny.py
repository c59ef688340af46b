"""Tiny random checkpoints built with transformers, and transformers'
float32 answers on them: what a model plugin's tests compare against.

The weights are drawn larger than transformers' default init (matrices
N(0, ``scale``), every other parameter shifted by noise) so logits are far
from flat and greedy decoding has no near-ties. torch is imported inside
the functions, so importing ``plinth.testing`` stays cheap."""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, Sequence


def save_random_model(
    config: Any,
    path: str,
    *,
    seed: int,
    scale: float = 0.08,
    vector_noise: float = 0.05,
    adjust: Callable[[Any], None] | None = None,
) -> str:
    """``AutoModelForCausalLM.from_config(config)`` in float32 with seeded
    random weights, saved to ``path`` as safetensors (kept when ``path``
    already holds a config.json). ``adjust(model)`` runs after the draw, under
    no_grad, for what a model needs beyond it (a router bias, say)."""
    import torch
    from transformers import AutoModelForCausalLM

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, scale)
            else:
                p.add_(torch.randn_like(p) * vector_noise)
        if adjust is not None:
            adjust(model)
    model.save_pretrained(path, safe_serialization=True)
    return path


def random_prompts(vocab: int, lengths: Sequence[int], seed: int = 0) -> list[list[int]]:
    """Token ids drawn uniformly from ``[0, vocab)``, one prompt per length."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@functools.cache
def reference_model(path: str) -> Any:
    """transformers' model of a saved folder, float32, eval mode (one per path)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def reference_greedy(path: str, prompts: Sequence[Sequence[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one at a time (no padding)."""
    import torch

    model = reference_model(path)
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([list(prompt)])
            ids = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            out.append(ids[0, len(prompt) :].tolist())
    return out
