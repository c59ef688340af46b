"""FP8 checkpoints: ``quantization_config: {quant_method: fp8}``.

Two layouts, as Hugging Face folders store them:

* block-scaled (DeepSeek-V3, Qwen3-*-FP8): ``weight_block_size: [128, 128]``;
  each linear weight is float8_e4m3fn [N, K] with a float32
  ``<name>.weight_scale_inv`` of [ceil(N/128), ceil(K/128)], one multiplier
  per block (real = fp8 * scale_inv);
* per-tensor: no block size; one scale per weight (``weight_scale`` or
  ``weight_scale_inv``, a multiplier too). Static ``input_scale`` tensors are
  not used: activations are quantized dynamically.

The checkpoint is read with the modelling kit (``plinth.api.iter_fp8_checkpoint``):
one tensor at a time, moved to the model's device in FP8 with its scale. Which
path a weight takes is decided by the op table's capabilities, not by device names:

* the backend declares an ``fp8`` path (the triton backend: block-scaled
  W8A8 on GPUs with native FP8, weight-only FP8 GEMMs otherwise): the dense
  layers' projections stay ``QuantizedWeight``s on the device, are fused
  there (q/k/v, gate/up with their scales) and handed to ``ops.pack_linear``
  as they are, with no dense copy made first (tp = 1; the MoE experts, the
  embedding and the output head are dequantized on the device);
* otherwise (the torch reference, cpukernels: every CPU): every FP8 weight is
  dequantized on the device to the compute dtype (weight-only: the memory
  and the arithmetic of that dtype).

The loader logs the path taken and why (``plinth.llama``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from plinth.api import LoadContext, NameMap, fp8_block_size, iter_fp8_checkpoint

log = logging.getLogger("plinth.llama")

#: the dense layers' projections (the model's keys) kept in FP8 on the backend's path
KEPT = ("q", "k", "v", "o", "gate", "up", "down")


@dataclass
class FP8Plan:
    """How one FP8 checkpoint loads: its block size and whether the dense
    projections stay FP8 (the backend's path) or are dequantized."""

    block: tuple[int, int] | None
    keep: bool

    def tensors(self, folder: str, names: NameMap, ctx: LoadContext) -> Iterator[tuple[str, Any]]:
        def kept(name: str) -> bool:
            where = names(name)
            return self.keep and where is not None and where[0] is not None and where[1] in KEPT

        return iter_fp8_checkpoint(folder, self.block, device=ctx.device, dtype=ctx.dtype, keep=kept, progress=ctx.progress)


def fp8_plan(hf_config: Mapping[str, Any], ops: Any, dtype: Any, tp_size: int = 1) -> FP8Plan | None:
    """The plan when config.json says the weights are FP8, else None (logged)."""
    block = fp8_block_size(hf_config)
    if block is False:
        return None
    block = block if isinstance(block, tuple) else None
    scheme = f"block {block[0]}x{block[1]}" if block else "per-tensor"
    compute = str(dtype).removeprefix("torch.")
    caps = ops.capabilities
    if not caps.fp8:
        keep, path, why = False, f"FP8 ({scheme}) weight-only: dequantized at load to {compute}", "the backend has no FP8 kernels (its capabilities declare no fp8 path)"
    elif tp_size > 1:
        keep, path, why = False, f"FP8 ({scheme}) weight-only: dequantized at load to {compute}", f"FP8 weights are kept only at tp = 1 (tp = {tp_size})"
    else:
        keep = True
        path = f"FP8 ({scheme}) kept in FP8, the backend's {caps.fp8} path for the dense layers' projections (experts, embedding and head dequantized at load)"
        why = caps.fp8_why
    log.info("%s: %s", path, why)
    return FP8Plan(block, keep)
