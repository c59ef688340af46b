"""A tiny random Llama quantized to FP8 the way DeepSeek-V3 / Qwen3-FP8
checkpoints are (``quant_method: fp8``, ``weight_block_size: [128, 128]``,
float8_e4m3fn weights with float32 ``weight_scale_inv`` per 128x128 block),
or per tensor (one ``weight_scale``), saved beside its dequantized twin: the
same model with every quantized weight replaced by fp8 * scale in float32,
as an ordinary checkpoint transformers runs.

    python plugins/models/llama/tests/tiny_fp8.py OUT_DIR   # writes OUT_DIR/{fp8-block,twin-block}
"""

from __future__ import annotations

import json
import os
import sys

import torch

FP8_MAX = 448.0
BLOCK = 128
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny_config():
    import transformers

    # every projection's rows and columns a whole number of 128-blocks but
    # down_proj's input (384 = 3 blocks) and the k/v rows (128: one block)
    return transformers.LlamaConfig(
        vocab_size=300, hidden_size=256, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
        eos_token_id=263, bos_token_id=None, rope_theta=10000.0,
    )


def quantize_block(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    pn, pk = -(-n // block) * block, -(-k // block) * block
    wp = torch.zeros(pn, pk)
    wp[:n, :k] = w.float()
    blocks = wp.view(pn // block, block, pk // block, block)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(pn, pk)[:n, :k].contiguous(), scale


def dequantize_block(q: torch.Tensor, scale: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    n, k = q.shape
    return q.float() * scale.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]


def save_fp8_and_twin(root: str, scheme: str = "block", seed: int = 0) -> tuple[str, str]:
    """(fp8 folder, twin folder) of one random tiny Llama."""
    from safetensors.torch import save_file
    from tiny_models import write_tokenizer
    from transformers import AutoModelForCausalLM

    fp8_dir, twin_dir = os.path.join(root, f"fp8-{scheme}"), os.path.join(root, f"twin-{scheme}")
    if os.path.exists(os.path.join(fp8_dir, "config.json")):
        return fp8_dir, twin_dir
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.06)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    fp8_state = {}
    for name, w in state.items():
        if name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS:
            if scheme == "block":
                q, s = quantize_block(w)
                fp8_state[name], fp8_state[name.replace(".weight", ".weight_scale_inv")] = q, s
                deq = dequantize_block(q, s)
            else:
                s = w.abs().max().clamp(min=1e-12) / FP8_MAX
                q = (w / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
                fp8_state[name], fp8_state[name.replace(".weight", ".weight_scale")] = q, s.reshape(1)
                deq = q.float() * s
            state[name] = deq  # the twin: the dequantized values, float32
        else:
            fp8_state[name] = w
    with torch.no_grad():
        model.load_state_dict(state)
    model.save_pretrained(twin_dir, safe_serialization=True)
    write_tokenizer(twin_dir)
    os.makedirs(fp8_dir, exist_ok=True)
    save_file(fp8_state, os.path.join(fp8_dir, "model.safetensors"))
    cfg = json.load(open(os.path.join(twin_dir, "config.json")))
    qcfg = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3"}
    if scheme == "block":
        qcfg["weight_block_size"] = [BLOCK, BLOCK]
    cfg["quantization_config"] = qcfg
    with open(os.path.join(fp8_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    write_tokenizer(fp8_dir)
    return fp8_dir, twin_dir


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "tests"))
    for scheme in ("block", "tensor"):
        print(*save_fp8_and_twin(sys.argv[1], scheme))
