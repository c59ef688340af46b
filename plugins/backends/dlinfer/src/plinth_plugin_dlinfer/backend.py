"""The dlinfer backend: plinth's ops on DeepLink dlinfer's kernels, as
LMDeploy's PyTorch engine runs them (lmdeploy/pytorch/backends/dlinfer/).

``check()`` imports nothing: it finds dlinfer with ``find_spec`` and reads
the vendor it was built for from ``dlinfer/vendor/vendor.yaml`` (written by
dlinfer's setup.py at build time), then compares it with the chosen
accelerator's torch device type. The ops (``plinth_plugin_dlinfer.ops``)
import dlinfer only when this backend is chosen.

The op table (plinth op -> dlinfer op, or why the reference serves it) is
``OP_MAP`` below, and the README's table.
"""

from __future__ import annotations

import importlib.util
import logging
import pathlib
from typing import Any, Callable, Mapping

from plinth.api import Backend, PluginError, SelectionContext

log = logging.getLogger("plinth.dlinfer")

#: vendor (dlinfer's vendor.yaml) -> the torch device type its kernels run on
VENDOR_DEVICE = {"ascend": "npu", "camb": "mlu", "maca": "cuda"}
#: the vendors whose cache layout and step metadata this backend implements
#: (LMDeploy's dlinfer/ascend/op_backend.py); camb keeps its cache
#: [heads, block, dim] (camb/op_backend.py:23-33) with other metadata
SUPPORTED_VENDORS = ("ascend",)
#: the dtypes Ascend's attention kernels (ATB reshape_and_cache, npu_fused_infer_attention_score) take
DTYPES = ("float16", "bfloat16")

#: plinth op -> the dlinfer op behind it, or "reference: why"
OP_MAP = {
    "attention": "fill_kv_cache, then prefill_attention (no cached prefix) / paged_prefill_attention / paged_decode_attention",
    "prepare_attention": "this plugin: the step metadata LMDeploy's AscendOpsBackend.update_step_context builds",
    "allocate_kv_cache": "this plugin: Ascend's layout [pages, page_size, kv_heads, head_dim] for K and for V",
    "copy_pages": "this plugin: index copy along the page dimension (dlinfer has no page copy)",
    "rms_norm": "rms_norm; with a residual, add_rms_norm",
    "rotary": "apply_rotary_pos_emb (NeoX halves; GPT-J pairs: the reference)",
    "silu_and_mul": "silu_and_mul",
    "linear": "linear (dense weights; quantized weights: the reference)",
    "pack_linear": "this plugin: dense weights as they are (quantized: the reference)",
    "fused_moe": "fused_moe (renormalize=False: plinth's models weight the experts themselves)",
    "qkv_attention": "reference: not provided (a fusion dlinfer has no kernel for; models compose rotary + attention)",
}
#: dlinfer ops plinth does not call, and why
DECLINED = {
    "moe_gating_topk_softmax": "plinth's MoE models route in the model (softmax in float32, top-k, renormalize); no op to map it to",
    "linear_w8a8, dynamic_quant, rms_norm_w8a8, add_rms_norm_w8a8": "no checkpoint format plinth loads is smooth-quant W8A8 (int8 weights, per-token dynamic scales)",
    "weight_quant_matmul": "W4A16 AWQ checkpoints are not loaded by plinth's model plugins; FP8/GGUF are dequantized at load",
    "incre_flash_attention, fused_attention, fill_contiguous_kvcache, get_cache_len": "transformers-patching helpers for contiguous caches; plinth's cache is paged",
    "transdata": "graph mode only (ND -> NZ); plinth runs eager",
}


def dlinfer_vendor() -> tuple[str | None, str]:
    """(vendor, why not): the vendor the installed dlinfer was built for, read
    from its vendor.yaml without importing it; None and the reason when
    dlinfer is absent or has no vendor file."""
    spec = importlib.util.find_spec("dlinfer")
    if spec is None:
        return None, "dlinfer is not installed (pip install 'plinth-plugin-dlinfer[ascend]', which installs dlinfer-ascend)"
    roots = list(spec.submodule_search_locations or [])
    path = pathlib.Path(roots[0]) / "vendor" / "vendor.yaml" if roots else None
    if path is None or not path.is_file():
        return None, f"dlinfer at {roots[0] if roots else spec.origin} has no vendor/vendor.yaml (a source tree, not a vendor build)"
    for line in path.read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "vendor":
            return value.strip().strip("'\""), ""
    return None, f"{path} names no vendor"


def page_size_problem(page_size: int) -> str | None:
    """Why the vendor's paged kernels cannot take ``page_size`` (None: they can).
    dlinfer asserts nothing; its caller LMDeploy requires it of every
    vendor (lmdeploy/messages.py:532-535: ``>= 16 and a power of 2``)."""
    if page_size >= 16 and page_size & (page_size - 1) == 0:
        return None
    return (
        f"page size {page_size} is not allowed by dlinfer's paged attention kernels: they take a power of two of "
        "at least 16 (--page-size 16, 32, 64 or 128; 128 is what LMDeploy runs on Ascend)"
    )


def model_problems(model: Any) -> list[str]:
    """What in a model's attention dlinfer's kernels cannot do."""
    if model is None:
        return []
    raw = model.raw or {}
    reasons = []
    if raw.get("use_sliding_window") or "sliding_attention" in (raw.get("layer_types") or ()):
        reasons.append(f"{model.architecture} uses sliding-window attention, which dlinfer's paged attention ops do not take")
    if raw.get("attn_logit_softcapping"):
        reasons.append(f"{model.architecture} soft-caps attention logits, which dlinfer's attention ops do not take")
    if model.v_head_dim is not None and model.v_head_dim != model.head_dim:
        reasons.append(f"{model.architecture} caches latent (MLA) K/V; this backend lays out only K and V of one head size")
    return reasons


class DlinferBackend(Backend):
    """dlinfer's kernels for attention, norms, rotary, activation, MoE and GEMMs."""

    @classmethod
    def check(cls, ctx: SelectionContext) -> list[str]:
        reasons = []
        if importlib.util.find_spec("torch") is None:
            reasons.append("torch is not installed")
        vendor, why = dlinfer_vendor()
        if vendor is None:
            reasons.append(why)
        elif vendor not in VENDOR_DEVICE:
            reasons.append(f"dlinfer was built for vendor {vendor!r}, which this backend does not know ({', '.join(VENDOR_DEVICE)})")
        elif vendor not in SUPPORTED_VENDORS:
            reasons.append(
                f"dlinfer was built for {vendor}; this backend implements {', '.join(SUPPORTED_VENDORS)}'s KV cache layout and step metadata only"
            )
        acc = ctx.accelerator
        if acc is not None:
            device_type = getattr(acc, "device_type", "") or "unknown"
            if vendor in VENDOR_DEVICE:
                want = VENDOR_DEVICE[vendor]
                if device_type != want:
                    reasons.append(f"no {want.upper()} device: dlinfer ({vendor}) runs on {want} devices, the chosen device is {device_type}")
            elif device_type not in VENDOR_DEVICE.values():
                kinds = ", ".join(f"{d} ({v})" for v, d in VENDOR_DEVICE.items())
                reasons.append(f"no NPU, MLU or MACA device: dlinfer's kernels run on {kinds} devices, the chosen device is {device_type}")
        if ctx.dtype is not None and str(ctx.dtype).removeprefix("torch.") not in DTYPES:
            reasons.append(f"dtype {str(ctx.dtype).removeprefix('torch.')}: dlinfer's Ascend attention kernels take {' or '.join(DTYPES)}")
        reasons.extend(model_problems(ctx.model))
        return reasons

    def ops(self) -> Mapping[str, Callable[..., Any]]:
        from plinth_plugin_dlinfer.ops import make_ops

        missing = [op for op in ("rotary", "rms_norm", "linear", "pack_linear") if op not in self.reference]
        if missing:
            raise PluginError(f"dlinfer takes {', '.join(missing)} from the reference backend for the cases it declines, which is not available")
        for op, how in OP_MAP.items():
            log.info("backend dlinfer: %s <- %s", op, how)
        return make_ops(self.reference)
