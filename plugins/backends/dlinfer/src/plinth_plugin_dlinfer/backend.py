"""The dlinfer backend: plinth's ops on DeepLink dlinfer's kernels, as
LMDeploy's PyTorch engine runs them (lmdeploy/pytorch/backends/dlinfer/).

``check()`` imports nothing: it finds dlinfer with ``find_spec`` and reads
the vendor it was built for from ``dlinfer/vendor/vendor.yaml`` (written by
dlinfer's setup.py at build time), then compares it with the chosen
accelerator's torch device type. The compute ops (``plinth_plugin_dlinfer.ops``)
and the attention backend (``plinth_plugin_dlinfer.attention``: its KV layout,
page sizes, dtypes and the models it declines) import dlinfer only when this
backend is built.

The op table (plinth op -> dlinfer op, or why the reference serves it) is
``OP_MAP`` below, and the README's table.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import pathlib
import subprocess
import sys
from typing import Any, Callable, Mapping

from plinth.api import AttentionBackend, Backend, PluginError, SelectionContext

from plinth_plugin_dlinfer.attention import DlinferAttention

log = logging.getLogger("plinth.dlinfer")

#: vendor (dlinfer's vendor.yaml) -> the torch device type its kernels run on
VENDOR_DEVICE = {"ascend": "npu", "camb": "mlu", "maca": "cuda"}
#: the vendors whose cache layout and step metadata this backend implements
#: (LMDeploy's dlinfer/ascend/op_backend.py); camb keeps its cache
#: [heads, block, dim] (camb/op_backend.py:23-33) with other metadata
SUPPORTED_VENDORS = ("ascend",)

#: plinth op -> the dlinfer op behind it, or "reference: why"
OP_MAP = {
    "attention": "its attention backend: fill_kv_cache, then prefill_attention (no cached prefix) / paged_prefill_attention / "
    "paged_decode_attention, over Ascend's pages [pages, page_size, kv_heads, head_dim], with the step metadata "
    "LMDeploy's AscendOpsBackend.update_step_context builds; page copies: index copies along the page dimension",
    "rms_norm": "rms_norm; with a residual, add_rms_norm",
    "rotary": "apply_rotary_pos_emb (NeoX halves; GPT-J pairs: the reference)",
    "silu_and_mul": "silu_and_mul",
    "linear": "linear (dense weights; quantized weights: the reference)",
    "pack_linear": "this plugin: dense weights as they are (quantized: the reference)",
    "fused_moe": "fused_moe (renormalize=False: plinth's models weight the experts themselves)",
    "qkv_attention": "not provided (a fusion dlinfer has no kernel for; models compose rotary + attention)",
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


#: what the backend imports when it is built, run in a child process by check():
#: dlinfer-ascend 0.2.7 imports lmdeploy and torch_npu at import time (vendor/ascend/
#: torch_npu_ops.py:19 -> attention.py:4-8 -> framework/lmdeploy_ext/cudagraph/
#: ascend_cudagraph.py:10-21), and this backend calls the paged decode with the
#: q_seq_len that dlinfer v0.2.8 added (ops/llm.py:265-282)
IMPORT_PROBE = """
import inspect
import dlinfer.ops, dlinfer.utils.type_annotation
if "q_seq_len" not in inspect.signature(dlinfer.ops.paged_decode_attention).parameters:
    raise SystemExit("API: dlinfer " + getattr(__import__("dlinfer"), "__version__", "?") + "'s paged_decode_attention takes no q_seq_len")
"""
IMPORT_TIMEOUT_S = 300


@functools.lru_cache(maxsize=4)
def import_problem(path: tuple[str, ...]) -> str | None:
    """Why dlinfer cannot be imported as the backend will import it (None:
    it can), asked of a child process with ``path`` as its sys.path: an
    import that fails leaves half-initialised vendor modules behind, and
    torch_npu patches torch as it loads, so the server's own process is
    spared both. The last line of the error is the reason."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    try:
        proc = subprocess.run([sys.executable, "-c", IMPORT_PROBE], capture_output=True, text=True, timeout=IMPORT_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        return f"importing dlinfer did not finish in {IMPORT_TIMEOUT_S} s (in a child process)"
    if proc.returncode == 0:
        return None
    lines = [ln for ln in (proc.stderr or proc.stdout).strip().splitlines() if ln.strip()]
    last = lines[-1].strip() if lines else f"exit status {proc.returncode}"
    if last.startswith("API: "):
        return (
            f"{last.removeprefix('API: ')}: this backend calls dlinfer's v0.2.8 API (the paged decode takes q_seq_len); "
            "dlinfer-ascend 0.2.7 on PyPI predates it: install dlinfer from source at v0.2.8 or later"
        )
    hint = ""
    if "lmdeploy" in last:
        hint = " (dlinfer-ascend imports lmdeploy at import time: pip install 'plinth-plugin-dlinfer[ascend]', which brings a matching lmdeploy)"
    return f"dlinfer cannot be imported (checked in a child process): {last}{hint}"


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
                elif not reasons:  # chosen for real, on its device: import what the backend will import
                    problem = import_problem(tuple(p for p in sys.path if p))
                    if problem:
                        reasons.append(problem)
            elif device_type not in VENDOR_DEVICE.values():
                kinds = ", ".join(f"{d} ({v})" for v, d in VENDOR_DEVICE.items())
                reasons.append(f"no NPU, MLU or MACA device: dlinfer's kernels run on {kinds} devices, the chosen device is {device_type}")
        return reasons

    @classmethod
    def attention_backend(cls, ctx: SelectionContext) -> type[AttentionBackend[Any]]:
        # its problems (page size, dtype, the model's attention) are this backend's: see Backend.validate
        return DlinferAttention

    def ops(self) -> Mapping[str, Callable[..., Any]]:
        from plinth_plugin_dlinfer.ops import make_ops

        missing = [op for op in ("rotary", "rms_norm", "linear", "pack_linear") if op not in self.reference]
        if missing:
            raise PluginError(f"dlinfer takes {', '.join(missing)} from the reference backend for the cases it declines, which is not available")
        for op, how in OP_MAP.items():
            log.info("backend dlinfer: %s <- %s", op, how)
        return make_ops(self.reference)
