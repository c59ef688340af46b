"""FP8 checkpoints: ``quantization_config: {quant_method: fp8}``.

Two layouts, as Hugging Face folders store them:

* block-scaled (DeepSeek-V3, Qwen3-*-FP8): ``weight_block_size: [128, 128]``;
  each linear weight is float8_e4m3fn [N, K] with a float32
  ``<name>.weight_scale_inv`` of [ceil(N/128), ceil(K/128)], one multiplier
  per block (real = fp8 * scale_inv);
* per-tensor: no block size; one scale per weight (``weight_scale`` or
  ``weight_scale_inv``, a multiplier too). Static ``input_scale`` tensors are
  not used: activations are quantized dynamically.

Which path a model takes is decided by the op table's capabilities, not by device names:

* the backend declares an ``fp8`` path (the triton backend: block-scaled
  W8A8 on GPUs with native FP8, weight-only FP8 GEMMs otherwise): the dense
  layers' projections are handed to ``ops.pack_linear`` as ``QuantizedWeight``s
  and stay FP8 in memory (tp = 1; the MoE experts, the embedding and the
  output head are dequantized at load);
* otherwise (the torch reference, cpukernels: every CPU): every FP8 weight is
  dequantized at load to the compute dtype (weight-only: the memory and the
  arithmetic of that dtype).

The loader logs the path taken and why (``plinth.llama``).
"""

from __future__ import annotations

import logging
from typing import Any, Iterator, Mapping

import torch
from plinth.api import ConfigError, QuantizedWeight, safetensors_files

log = logging.getLogger("plinth.llama")

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
#: checkpoint projection -> (the model layer's attribute, its part)
_FUSED = {"q": ("qkv", 0), "k": ("qkv", 1), "v": ("qkv", 2), "o": ("o_proj", 0), "gate": ("gate_up", 0), "up": ("gate_up", 1), "down": ("down", 0)}


class FP8Checkpoint:
    """One FP8 checkpoint being loaded: reads its tensors, dequantizes or keeps them."""

    def __init__(self, qcfg: Mapping[str, Any], ops: Any, dtype: torch.dtype, tp_size: int = 1) -> None:
        block = qcfg.get("weight_block_size")
        if block is not None and (len(block) != 2 or not all(int(b) > 0 for b in block)):
            raise ConfigError(f"fp8 quantization_config: weight_block_size {block!r} is not [rows, cols]")
        self.block = (int(block[0]), int(block[1])) if block else None
        self.dtype = dtype
        self.ops = ops
        self.kept: dict[tuple[int, str], QuantizedWeight] = {}
        caps = ops.capabilities
        scheme = f"block {self.block[0]}x{self.block[1]}" if self.block else "per-tensor"
        if not caps.fp8:
            self.keep = False
            self.path = f"FP8 ({scheme}) weight-only: dequantized at load to {str(dtype).removeprefix('torch.')}"
            self.why = "the backend has no FP8 kernels (its capabilities declare no fp8 path)"
        elif tp_size > 1:
            self.keep = False
            self.path = f"FP8 ({scheme}) weight-only: dequantized at load to {str(dtype).removeprefix('torch.')}"
            self.why = f"FP8 weights are kept only at tp = 1 (tp = {tp_size})"
        else:
            self.keep = True
            path, why = caps.fp8, caps.fp8_why
            self.path = f"FP8 ({scheme}) kept in FP8, the backend's {path} path for the dense layers' projections (experts, embedding and head dequantized at load)"
            self.why = why
        log.info("%s: %s", self.path, self.why)

    # ---- reading ------------------------------------------------------------------------

    def tensors(self, folder: str, map_name: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) for every tensor but the scales, FP8 weights
        dequantized to the compute dtype (kept aside as ``QuantizedWeight``s
        too when the backend computes in FP8). ``map_name(name)`` -> (layer,
        key) or None, the loader's name mapping."""
        from safetensors import safe_open

        handles = [safe_open(str(path), framework="pt", device="cpu") for path in safetensors_files(folder)]
        where = {name: h for h in handles for name in h.keys()}
        for name, handle in where.items():
            if name.rsplit(".", 1)[-1] in ("weight_scale_inv", "weight_scale", "input_scale"):
                continue
            tensor = handle.get_tensor(name)
            if tensor.dtype in FP8_DTYPES:
                base = name.removesuffix(".weight")
                scale_name = next((f"{base}.{s}" for s in ("weight_scale_inv", "weight_scale") if f"{base}.{s}" in where), None)
                if scale_name is None:
                    raise ConfigError(f"FP8 weight {name} has no weight_scale_inv / weight_scale tensor")
                scale = where[scale_name].get_tensor(scale_name).to(torch.float32)
                qw = QuantizedWeight(
                    format="fp8_e4m3" if tensor.dtype == torch.float8_e4m3fn else "fp8_e5m2",
                    qweight=tensor,
                    scale=scale,
                    shape=(tensor.shape[0], tensor.shape[1]),
                    block_size=self.block if self.block is not None and scale.dim() == 2 else None,
                )
                mapped = map_name(name) if self.keep else None
                if mapped is not None and mapped[0] is not None and mapped[1] in _FUSED and qw.format == "fp8_e4m3":
                    self.kept[mapped] = qw
                tensor = dequantize(qw, self.dtype)
            elif tensor.is_floating_point() and tensor.dtype != self.dtype:
                tensor = tensor.to(self.dtype)
            yield name, tensor

    # ---- after the model is built ---------------------------------------------------------

    def finish(self, model: Any) -> Any:
        """Swap the dense layers' projections for FP8 ones (the kept path)."""
        if not self.keep or not self.kept:
            return model
        swapped = 0
        for i, layer in enumerate(model.layers):
            for attr in ("qkv", "o_proj", "gate_up", "down"):
                parts = sorted((part, qw) for (li, key), qw in self.kept.items() if li == i and _FUSED[key][0] == attr for part in [_FUSED[key][1]])
                expected = {"qkv": 3, "gate_up": 2}.get(attr, 1)
                if len(parts) != expected or getattr(layer, attr, None) is None:
                    continue  # not quantized, or an MoE layer: stays as built
                fused = fuse_rows([qw for _, qw in parts])
                if fused is None:
                    log.info("layer %d %s: FP8 parts do not align to %s-row blocks: kept dequantized", i, attr, self.block)
                    continue
                setattr(layer, attr, self.ops.pack_linear(fused))
                swapped += 1
        self.kept.clear()
        log.info("FP8: %d projections kept in FP8", swapped)
        return model


def dequantize(qw: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """fp8 * scale in float32, then the compute dtype."""
    n, k = qw.shape
    q = qw.qweight.to(torch.float32)
    s = qw.scale.to(torch.float32)
    if s.numel() == 1:
        return (q * s.reshape(())).to(dtype)
    if qw.block_size is None:
        if s.numel() == n:
            return (q * s.reshape(n, 1)).to(dtype)
        raise ConfigError(f"an FP8 scale of shape {tuple(s.shape)} for a weight {qw.shape} needs weight_block_size in the config")
    bn, bk = qw.block_size
    if s.shape != (-(-n // bn), -(-k // bk)):
        raise ConfigError(f"an FP8 block scale of shape {tuple(s.shape)} does not fit a weight {qw.shape} in {bn}x{bk} blocks")
    full = s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (q * full).to(dtype)


def fuse_rows(parts: list[QuantizedWeight]) -> QuantizedWeight | None:
    """QuantizedWeights stacked along the output rows (q, k, v; gate, up) as
    one; None when block scales cannot be stacked (a part's rows are not a
    whole number of blocks). Per-tensor scales become per-row ones."""
    if len(parts) == 1:
        return parts[0]
    k = parts[0].shape[1]
    if any(p.shape[1] != k for p in parts) or len({p.format for p in parts}) != 1:
        return None
    q = torch.cat([p.qweight for p in parts])
    n = q.shape[0]
    blocks = {p.block_size for p in parts}
    if blocks == {None}:
        scale = torch.cat([p.scale.reshape(-1).expand(p.shape[0]) if p.scale.numel() == 1 else p.scale.reshape(-1) for p in parts])
        return QuantizedWeight(format=parts[0].format, qweight=q, scale=scale, shape=(n, k))
    if len(blocks) != 1 or None in blocks:
        return None
    block = parts[0].block_size
    assert block is not None  # one block size, not None (checked above)
    bn, _ = block
    if any(p.shape[0] % bn for p in parts[:-1]):
        return None
    return QuantizedWeight(format=parts[0].format, qweight=q, scale=torch.cat([p.scale for p in parts]), shape=(n, k), block_size=parts[0].block_size)


def fp8_checkpoint(hf_config: Mapping[str, Any], ops: Any, dtype: torch.dtype, tp_size: int = 1) -> FP8Checkpoint | None:
    """An FP8Checkpoint when config.json says the weights are FP8, else None."""
    qcfg = hf_config.get("quantization_config") or {}
    method = str(qcfg.get("quant_method", "")).lower()
    if not method:
        return None
    if method != "fp8":
        raise ConfigError(f"quantization_config quant_method {method!r} is not supported (supported: fp8)")
    return FP8Checkpoint(qcfg, ops, dtype, tp_size)
