"""Block-scaled FP8 checkpoints (as DeepSeek-V3 and Kimi K2 ship): weights in
float8_e4m3fn with a float32 ``weight_scale_inv`` per block, dequantized at
load. A tiny DeepSeek-V3 quantized so (16 x 16 blocks, edge blocks cut) gives
the logits transformers gives for the same dequantized weights."""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file
from test_deepseek_vs_transformers import load_ours, prefill_logits
from tiny_deepseek import prompts, reference, saved_model

BLOCK = (16, 24)  # blocks that do not divide every weight: edge blocks are cut


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out, inp = w.shape
    rows, cols = -(-out // BLOCK[0]), -(-inp // BLOCK[1])
    scale = torch.empty(rows, cols)
    q = torch.empty(out, inp, dtype=torch.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            part = w[i * BLOCK[0] : (i + 1) * BLOCK[0], j * BLOCK[1] : (j + 1) * BLOCK[1]]
            scale[i, j] = part.abs().max().clamp(min=1e-12) / 448.0
            q[i * BLOCK[0] : (i + 1) * BLOCK[0], j * BLOCK[1] : (j + 1) * BLOCK[1]] = (part / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def fp8_pair(root: str) -> tuple[str, str]:
    """(the FP8 checkpoint, the same weights dequantized in float32)."""
    src = saved_model("q_lora", root)
    fp8, deq = os.path.join(root, "fp8"), os.path.join(root, "fp8-dequantized")
    if os.path.exists(fp8):
        return fp8, deq
    shutil.copytree(src, fp8)
    shutil.copytree(src, deq)
    (st,) = [f for f in os.listdir(src) if f.endswith(".safetensors")]
    tensors = load_file(os.path.join(src, st))
    quantized, dequantized = {}, {}
    for name, w in tensors.items():
        # DeepSeek's FP8 layers: every projection and expert weight, not norms, router, embedding or head
        if ".layers." in name and name.endswith(("proj.weight", "proj_with_mqa.weight")):
            q, s = _quantize(w)
            quantized[name], quantized[name + "_scale_inv"] = q, s
            dequantized[name] = q.float() * s.repeat_interleave(BLOCK[0], 0)[: w.shape[0]].repeat_interleave(BLOCK[1], 1)[:, : w.shape[1]]
        else:
            quantized[name] = dequantized[name] = w
    save_file(quantized, os.path.join(fp8, st), metadata={"format": "pt"})
    save_file(dequantized, os.path.join(deq, st), metadata={"format": "pt"})
    with open(os.path.join(fp8, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}
    with open(os.path.join(fp8, "config.json"), "w") as f:
        json.dump(cfg, f)
    return fp8, deq


def test_fp8_checkpoint_dequantized_at_load_matches_transformers(tmp_path):
    fp8, deq = fp8_pair(str(tmp_path))
    model, ops, _ = load_ours(fp8)
    assert model.layers[2].w13.dtype == torch.float32  # dequantized at load
    worst, moved = 0.0, 0.0
    with torch.no_grad():
        for prompt, logits in zip(prompts(), prefill_logits(model, ops, prompts(), page_size=16)):
            ref = reference(deq)(torch.tensor([prompt])).logits[0]
            worst = max(worst, (logits - ref).abs().max().item())
            moved = max(moved, (reference(saved_model("q_lora", str(tmp_path)))(torch.tensor([prompt])).logits[0] - ref).abs().max().item())
    assert worst < 1e-4, f"max |logit diff| {worst:.3g}"
    assert moved > 1e-3  # the quantization changed the model: the check above could tell a skipped scale


def test_host_memory_peak_of_an_fp8_load_is_bounded_by_its_shards(tmp_path):
    """A sharded FP8 checkpoint (about 50 MB in FP8, one shard per layer)
    loaded onto a device that holds no host memory (meta): the resident
    set's peak grows by at most twice the largest shard. Each weight goes
    to the device in FP8 and is dequantized there, one shard open at a time;
    before, every FP8 weight was dequantized to float32 in host memory and
    held until the model was built (about 4x the checkpoint)."""
    import subprocess
    import sys

    import fp8_ram

    folder = str(tmp_path / "fp8-sharded")
    sizes = fp8_ram.save(folder)
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run([sys.executable, os.path.join(here, "fp8_ram.py"), folder], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    peak = json.loads(out.stdout.strip().splitlines()[-1])["peak"]
    assert peak <= 2 * max(sizes), f"host peak grew {peak / 2**20:.1f} MiB, shards {[round(s / 2**20, 1) for s in sizes]} MiB"
