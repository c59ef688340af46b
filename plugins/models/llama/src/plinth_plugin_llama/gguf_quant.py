"""GGUF weights kept in their quantized blocks, where the backend runs them.

Which path a GGUF model takes is decided by the op table's capabilities, not by device names
(as for FP8 checkpoints, fp8.py):

* the backend declares ``gguf_formats`` in its capabilities (cpukernels:
  Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K with integer dot products on the
  blocks), tp = ep = 1 and no ``--dequantize``: the linear weights of a type
  it names are handed to ``ops.pack_linear`` as ``QuantizedWeight(format=
  "gguf_<type>", qweight=<the file's rows of blocks>)``: the attention and MLP
  projections (q/k/v and gate/up fused by stacking block rows, when their
  types agree) and the output head; a tied head (no ``output.weight``) is the
  embedding's blocks, while the embedding itself (a gather) is dequantized;
* otherwise every weight is dequantized at load to the compute dtype, as
  before (``--dequantize`` gives exactly that path).

What stays quantized and why the rest does not is logged (``plinth.llama``).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Iterator

import torch
from plinth.api import GGUFFile, LoadContext, QuantizedWeight

log = logging.getLogger("plinth.llama")

#: per layer: the GGUF weights fused into one linear (kept only together)
LINEAR_GROUPS = (("attn_q", "attn_k", "attn_v"), ("attn_output",), ("ffn_gate", "ffn_up"), ("ffn_down",))
EMBEDDING, OUTPUT = "token_embd.weight", "output.weight"


class GGUFWeights:
    """Which of a GGUF file's weights stay in their blocks, and the tensors to load."""

    def __init__(self, gguf: GGUFFile, ctx: LoadContext, num_layers: int) -> None:
        self.gguf = gguf
        self.ctx = ctx
        self.kept: set[str] = set()
        self.tied_head = False
        dtype = str(ctx.dtype).removeprefix("torch.")
        quantized = [n for n in gguf.tensor_names if gguf.tensor_type(n) not in ("F32", "F16", "BF16", "F64")]
        caps = ctx.ops.capabilities
        if not quantized:
            self.why = "no quantized weights in the file"
        elif ctx.dequantize:
            self.why = f"dequantized at load to {dtype}: --dequantize"
        elif not caps.gguf_formats:
            self.why = f"dequantized at load to {dtype}: the backend runs no GGUF formats (its capabilities declare none)"
        elif ctx.tp_size > 1 or ctx.ep_size > 1:
            self.why = f"dequantized at load to {dtype}: GGUF blocks are kept only at tp = ep = 1 (tp = {ctx.tp_size}, ep = {ctx.ep_size})"
        else:
            formats, path = caps.gguf_formats, caps.gguf_path
            self._choose(set(formats), num_layers)
            types = Counter(gguf.tensor_type(n) for n in self.kept)
            rest = Counter(gguf.tensor_type(n) for n in quantized if n not in self.kept and n != EMBEDDING)
            head = "the tied output head (the embedding's blocks)" if self.tied_head else "the output head" if OUTPUT in self.kept else "not the output head"
            self.why = (
                f"{len(self.kept)} linear weights kept in their blocks ({', '.join(f'{c} {t}' for t, c in sorted(types.items()))}; "
                f"{head}), the backend's {path}; embedding dequantized to {dtype}"
                + (f"; dequantized: {', '.join(f'{c} {t}' for t, c in sorted(rest.items()))} (a type it does not run, or fused with one)" if rest else "")
            )
        log.info("GGUF weights: %s", self.why)

    def _choose(self, formats: set[str], num_layers: int) -> None:
        gguf = self.gguf

        def runnable(name: str) -> bool:
            return gguf.has_tensor(name) and gguf.tensor_type(name) in formats and len(gguf.tensor_shape(name)) == 2

        for i in range(num_layers):
            for group in LINEAR_GROUPS:
                names = [f"blk.{i}.{part}.weight" for part in group]
                if all(runnable(n) for n in names) and len({gguf.tensor_type(n) for n in names}) == 1:
                    self.kept.update(names)
        if gguf.has_tensor(OUTPUT):
            if runnable(OUTPUT):
                self.kept.add(OUTPUT)
        elif runnable(EMBEDDING):
            self.kept.add(EMBEDDING)
            self.tied_head = True

    def tensors(self) -> Iterator[tuple[str, "torch.Tensor | QuantizedWeight"]]:
        """Every tensor dequantized as before, but the kept ones as
        QuantizedWeights (a tied head under the name ``output.weight``)."""
        skip = self.kept - {EMBEDDING}
        yield from self.gguf.iter_tensors(dtype=self.ctx.dtype, progress=self.ctx.progress, select=lambda n: n not in skip)
        for name in sorted(self.kept):
            yield (OUTPUT if name == EMBEDDING else name), self.gguf.quantized_weight(name)
