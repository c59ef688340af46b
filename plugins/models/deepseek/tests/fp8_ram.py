"""A sharded block-scaled FP8 DeepSeek-V3 checkpoint big enough to measure
(about 50 MB in FP8, one shard per layer), and the host-memory peak of its
load onto a device that holds no host memory (``meta``): run as a script in
a process of its own, it prints the peak growth of the resident set during
``DeepseekLoader.load_model`` (VmHWM reset through /proc/self/clear_refs),
measured on the process's second load."""

from __future__ import annotations

import json
import os
import sys

import torch

CONFIG = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=4096, hidden_size=1024,
    num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=256, kv_lora_rank=256,
    qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, intermediate_size=2048, moe_intermediate_size=512,
    first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
    norm_topk_prob=True, routed_scaling_factor=2.5, rms_norm_eps=1e-6, max_position_embeddings=512, tie_word_embeddings=False,
    rope_theta=10000.0, torch_dtype="bfloat16",
    quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
)  # fmt: skip
BLOCK = 128


def _fp8(out: dict, name: str, rows: int, cols: int, g: torch.Generator) -> None:
    out[name] = (torch.randn(rows, cols, generator=g) * 100).to(torch.float8_e4m3fn)
    out[name + "_scale_inv"] = torch.rand(-(-rows // BLOCK), -(-cols // BLOCK), generator=g) * 1e-3


def save(folder: str) -> list[int]:
    """Write the checkpoint; returns each shard's size in bytes."""
    from safetensors.torch import save_file

    c = CONFIG
    os.makedirs(folder, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    h, heads = c["hidden_size"], c["num_attention_heads"]
    dn, dr, dv, rank, ql = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"], c["q_lora_rank"]
    shards = [{
        "model.embed_tokens.weight": torch.randn(c["vocab_size"], h, generator=g).bfloat16(),
        "model.norm.weight": torch.ones(h).bfloat16(),
        "lm_head.weight": torch.randn(c["vocab_size"], h, generator=g).bfloat16(),
    }]  # fmt: skip
    for i in range(c["num_hidden_layers"]):
        p, t = f"model.layers.{i}.", {}
        t[p + "input_layernorm.weight"] = torch.ones(h).bfloat16()
        t[p + "post_attention_layernorm.weight"] = torch.ones(h).bfloat16()
        t[p + "self_attn.q_a_layernorm.weight"] = torch.ones(ql).bfloat16()
        t[p + "self_attn.kv_a_layernorm.weight"] = torch.ones(rank).bfloat16()
        _fp8(t, p + "self_attn.q_a_proj.weight", ql, h, g)
        _fp8(t, p + "self_attn.q_b_proj.weight", heads * (dn + dr), ql, g)
        _fp8(t, p + "self_attn.kv_a_proj_with_mqa.weight", rank + dr, h, g)
        _fp8(t, p + "self_attn.kv_b_proj.weight", heads * (dn + dv), rank, g)
        _fp8(t, p + "self_attn.o_proj.weight", h, heads * dv, g)
        if i < c["first_k_dense_replace"]:
            for part, (r, k) in {"gate_proj": (c["intermediate_size"], h), "up_proj": (c["intermediate_size"], h), "down_proj": (h, c["intermediate_size"])}.items():
                _fp8(t, p + f"mlp.{part}.weight", r, k, g)
        else:
            mi = c["moe_intermediate_size"]
            t[p + "mlp.gate.weight"] = torch.randn(c["n_routed_experts"], h, generator=g).bfloat16()
            t[p + "mlp.gate.e_score_correction_bias"] = torch.zeros(c["n_routed_experts"])
            for e in range(c["n_routed_experts"]):
                for part, (r, k) in {"gate_proj": (mi, h), "up_proj": (mi, h), "down_proj": (h, mi)}.items():
                    _fp8(t, p + f"mlp.experts.{e}.{part}.weight", r, k, g)
            for part, (r, k) in {"gate_proj": (mi, h), "up_proj": (mi, h), "down_proj": (h, mi)}.items():
                _fp8(t, p + f"mlp.shared_experts.{part}.weight", r, k, g)
        shards.append(t)
    weight_map, sizes = {}, []
    for j, t in enumerate(shards):
        name = f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(t, os.path.join(folder, name), metadata={"format": "pt"})
        sizes.append(os.path.getsize(os.path.join(folder, name)))
        weight_map.update(dict.fromkeys(t, name))
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(CONFIG, f)
    return sizes


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def measure(folder: str) -> int:
    """The growth of the resident set's peak while the model loads onto ``meta``."""
    from plinth.api import LoadContext, ModelSource, OpTable, SelectionContext, load_hf_config
    from plinth_plugin_deepseek.loader import DeepseekLoader
    from plinth_plugin_torch.attention import TorchAttention
    from plinth_plugin_torch.backend import TorchBackend

    hf = load_hf_config(folder)
    source = ModelSource(path=folder, format="hf", architecture=hf["architectures"][0], hf_config=hf)
    loader = DeepseekLoader()
    cfg = loader.load_config(source)
    ctx = LoadContext(device=torch.device("meta"), dtype=torch.bfloat16, ops=OpTable(TorchBackend(SelectionContext()).ops()),
                      attention=TorchAttention(SelectionContext()), progress=False)  # fmt: skip
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident set
    before = _status("VmRSS")
    model = loader.load_model(source, cfg, ctx)
    peak = _status("VmHWM") - before
    assert all(w.device.type == "meta" for w in model.weights() if isinstance(w, torch.Tensor))
    return peak


if __name__ == "__main__":
    # the first load of a process also pays one-time initialisation (the
    # safetensors and torch libraries' first use: about 150 MB here): load once
    # before the load that is measured
    first = measure(sys.argv[1])
    print(json.dumps({"first": first, "peak": measure(sys.argv[1])}))
