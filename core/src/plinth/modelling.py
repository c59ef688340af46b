"""The modelling kit model plugins share (exported by ``plinth.api``): rotary
tables, checkpoint name maps, FP8 checkpoints, and the scaffolding every
decoder's loader repeats (sorting a checkpoint's tensors into the model's
slots, a layer's weights as plain attributes, the tied output head).

Rope follows transformers' ``modeling_rope_utils`` operation for operation in
float32 (default, linear, dynamic NTK, llama3, yarn with its mscale), so the
tables match transformers' cos/sin exactly; a model with per-layer bases
(Gemma 3's local and global layers) asks for one table per distinct rope.

FP8 checkpoints (``quantization_config: {quant_method: fp8}``, block-scaled
as DeepSeek-V3 and Qwen3-FP8, or per tensor) are read one tensor at a time,
each weight with its scale, moved to the model's device in FP8 and
dequantized there (``dequantize_fp8``) or kept for the backend's FP8 path:
host memory holds one tensor, never a dequantized copy of the model.

torch is imported by the functions that compute; importing this module
stays cheap.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Sequence

from plinth.contract.backend import QuantizedWeight
from plinth.errors import ConfigError

if TYPE_CHECKING:
    import torch

log = logging.getLogger("plinth.modelling")

# ---- rope ---------------------------------------------------------------------------------

#: the rope types ``rope_inv_freq`` computes
ROPE_TYPES = ("default", "dynamic", "linear", "llama3", "yarn")


def rope_from_hf(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The rope parameters of a Hugging Face config as one dict: transformers
    5 writes ``rope_parameters`` (with rope_theta inside), older configs
    ``rope_theta`` and ``rope_scaling`` at the top; a per-layer-type nesting
    (Gemma 3's) is the caller's to read."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(params, Mapping) or ("rope_type" not in params and "type" not in params and "rope_theta" not in params):
        params = {}
    rope = dict(params)
    rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
    if rope["rope_type"] in ("llama3", "yarn", "longrope"):
        rope.setdefault("original_max_position_embeddings", cfg.get("original_max_position_embeddings") or cfg.get("max_position_embeddings"))
    return rope


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """Yarn's attention scaling for a context extended ``scale`` times."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_softmax_scale(rope: Mapping[str, Any]) -> float:
    """The factor yarn's ``mscale_all_dim`` puts on the softmax scale
    (mscale(factor, mscale_all_dim) squared: DeepSeek's ``softmax_scale``,
    transformers' ``yarn_apply_mscale``); 1 for other ropes."""
    if rope.get("rope_type", "default") == "default" or not rope.get("mscale_all_dim"):
        return 1.0
    m = yarn_mscale(rope["factor"], rope["mscale_all_dim"])
    return m * m


def _default_inv_freq(base: float, dim: int) -> "torch.Tensor":
    import torch

    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))


def _llama3(inv_freq: "torch.Tensor", rope: Mapping[str, Any]) -> "torch.Tensor":
    import torch

    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context_len = rope["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(base: float, dim: int, rope: Mapping[str, Any], max_position_embeddings: int) -> "tuple[torch.Tensor, float]":
    import torch

    original_max = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or max_position_embeddings / original_max
    attention_factor = rope.get("attention_factor")
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def rope_inv_freq(rope: Mapping[str, Any], rotary_dim: int, max_position_embeddings: int, *, family: str = "this model") -> "tuple[torch.Tensor, float]":
    """(inverse frequencies [rotary_dim / 2] in float32, cos/sin scaling).
    Dynamic NTK changes the frequencies only beyond ``max_position_embeddings``:
    within it (where the tables stop) it is the default rope, as in transformers."""
    base = float(rope.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", "default")
    if kind in ("default", "dynamic"):
        return _default_inv_freq(base, rotary_dim), 1.0
    if kind == "linear":
        return _default_inv_freq(base, rotary_dim) / float(rope["factor"]), 1.0
    if kind == "llama3":
        return _llama3(_default_inv_freq(base, rotary_dim), rope), 1.0
    if kind == "yarn":
        return _yarn(base, rotary_dim, rope, max_position_embeddings)
    raise ConfigError(f"rope type {kind!r} is not supported for {family} ({', '.join(ROPE_TYPES)})")


def rope_cos_sin(
    rope: Mapping[str, Any], rotary_dim: int, max_position_embeddings: int, num_positions: int, *,
    freq_factors: "torch.Tensor | None" = None, family: str = "this model",
) -> "torch.Tensor":
    """[num_positions, rotary_dim] float32: cos of every position's angles,
    then their sin (the layout the rotary op takes), times the rope's
    scaling. ``freq_factors`` (llama.cpp's rope_freqs tensor) divide the
    frequencies."""
    import torch

    inv_freq, scaling = rope_inv_freq(rope, rotary_dim, max_position_embeddings, family=family)
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.to(torch.float32)
    angles = torch.arange(num_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos() * scaling, angles.sin() * scaling), dim=-1)


def rope_tables(ropes: Sequence[Mapping[str, Any]], rotary_dim: int, max_position_embeddings: int, num_positions: int, *,
                family: str = "this model") -> "list[torch.Tensor]":
    """One table per layer for models whose layers rotate with their own
    bases (Gemma 3: local layers 10 000, global 1 000 000): layers with equal
    ropes share one tensor."""
    made: dict[tuple[tuple[str, Any], ...], Any] = {}
    out = []
    for rope in ropes:
        key = tuple(sorted((k, repr(v)) for k, v in rope.items()))
        if key not in made:
            made[key] = rope_cos_sin(rope, rotary_dim, max_position_embeddings, num_positions, family=family)
        out.append(made[key])
    return out


# ---- checkpoint names ---------------------------------------------------------------------

#: ``model.layers.<i>.<rest>`` (Hugging Face) and ``blk.<i>.<rest>`` (GGUF)
HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
GGUF_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")


#: the names every Llama-style decoder's checkpoint shares (Hugging Face):
#: whole-model tensors, and a layer's norms and projections, as the kit's keys
HF_DECODER_TOP = {"model.embed_tokens.weight": "embed", "model.norm.weight": "norm", "lm_head.weight": "lm_head"}
HF_DECODER_LAYER = {
    "input_layernorm.weight": "input_norm",
    "post_attention_layernorm.weight": "post_norm",
    **{f"self_attn.{p}_proj.weight": p for p in ("q", "k", "v", "o")},
    **{f"self_attn.{p}_norm.weight": f"{p}_norm" for p in ("q", "k")},
    **{f"mlp.{p}_proj.weight": p for p in ("gate", "up", "down")},
}
#: the same in llama.cpp's GGUF names
GGUF_DECODER_TOP = {"token_embd.weight": "embed", "output_norm.weight": "norm", "output.weight": "lm_head"}
GGUF_DECODER_LAYER = {
    "attn_norm.weight": "input_norm",
    "ffn_norm.weight": "post_norm",
    **{f"attn_{p}.weight": p for p in ("q", "k", "v")},
    "attn_output.weight": "o",
    **{f"attn_{p}_norm.weight": f"{p}_norm" for p in ("q", "k")},
    **{f"ffn_{p}.weight": p for p in ("gate", "up", "down")},
}


@dataclass
class DecoderShape:
    """The sizes every decoder's config names (a family's arch dataclass
    subclasses it and adds its own), read by ``decoder_shape_from_hf``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int


def decoder_shape_from_hf(cfg: Mapping[str, Any], *, max_position_embeddings: int = 2048) -> dict[str, Any]:
    """``DecoderShape``'s fields from a config.json (head_dim defaults to
    hidden / heads, the KV heads to the heads)."""
    heads = int(cfg["num_attention_heads"])
    return dict(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", max_position_embeddings)),
    )


def decoder_sizes(arch: Any, **given: Any) -> dict[str, Any]:
    """The sizes ``CheckpointLoader.model_config`` takes, read from a family's
    arch (``DecoderShape`` fields) where ``given`` does not name them (a
    latent cache's one KV "head" of its own width, say)."""
    keys = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")
    return {**{k: getattr(arch, k) for k in keys if k not in given}, **given}


@dataclass(frozen=True)
class NameMap:
    """Checkpoint tensor names -> (layer or None, the model's key).

    top: whole-model tensors; layer: names after the layer prefix
    (``layer_re``'s second group); experts: a pattern of per-expert names
    after the layer prefix (groups: the expert's index, its part) and
    ``expert_parts`` mapping the part's name to the key's last word
    (``expert.<e>.<part>``)."""

    top: Mapping[str, str]
    layer: Mapping[str, str]
    layer_re: re.Pattern[str] = HF_LAYER
    experts: re.Pattern[str] | None = None
    expert_parts: Mapping[str, str] = field(default_factory=dict[str, str])

    def __call__(self, name: str) -> tuple[int | None, str] | None:
        if name in self.top:
            return None, self.top[name]
        m = self.layer_re.match(name)
        if not m:
            return None
        rest = m.group(2)
        if rest in self.layer:
            return int(m.group(1)), self.layer[rest]
        e = self.experts.match(rest) if self.experts is not None else None
        if e:
            return int(m.group(1)), f"expert.{int(e.group(1))}.{self.expert_parts.get(e.group(2), e.group(2))}"
        return None


def expert_index(key: str) -> int | None:
    """The expert of a per-expert key (``expert.<e>.<part>``), else None."""
    return int(key.split(".")[1]) if key.startswith("expert.") else None


@dataclass
class CheckpointTensors:
    """A checkpoint's tensors in the model's slots: ``top`` (whole-model) and
    ``layers[i]`` (layer i's), keyed by the model's names."""

    top: dict[str, Any]
    layers: list[dict[str, Any]]


def sort_tensors(
    tensors: Iterable[tuple[str, Any]], names: Callable[[str], tuple[int | None, str] | None], num_layers: int, *,
    experts: Iterable[int] | None = None, transform: Callable[[str, int | None, str, Any], Any] | None = None,
) -> CheckpointTensors:
    """Every tensor the name map knows, in its slot: unknown names are
    skipped (logged at debug), per-expert tensors of experts not in
    ``experts`` (another ep rank's) are never kept, layers past
    ``num_layers`` (DeepSeek-V3's multi-token-prediction layer) are dropped.
    ``transform(name, layer, key, tensor)`` may change a tensor on its way."""
    mine = set(experts) if experts is not None else None
    out = CheckpointTensors(top={}, layers=[{} for _ in range(num_layers)])
    for name, tensor in tensors:
        where = names(name)
        if where is None:
            log.debug("ignoring checkpoint tensor %s", name)
            continue
        layer, key = where
        e = expert_index(key)
        if e is not None and mine is not None and e not in mine:
            continue  # another ep rank's expert: never kept
        if transform is not None:
            tensor = transform(name, layer, key, tensor)
        if layer is None:
            out.top[key] = tensor
        elif layer < num_layers:
            out.layers[layer][key] = tensor
    return out


def need(weights: Mapping[str, Any], key: str, where: str) -> Any:
    """``weights[key]``, or a ConfigError naming what the checkpoint lacks."""
    if key not in weights:
        raise ConfigError(f"the checkpoint has no {key} weight for {where}")
    return weights[key]


class LayerWeights:
    """Base of a decoder layer's weights (no compute of its own): the names in
    ``__slots__`` start as None and are plain attributes, so a backend may
    keep any of them in its own packed form."""

    __slots__: tuple[str, ...] = ()

    def __init__(self) -> None:
        for name in type(self).__slots__:
            setattr(self, name, None)


def output_head(top: Mapping[str, Any], embed: Any, tie_word_embeddings: bool, *, family: str = "the model") -> Any:
    """The output head: the checkpoint's ``lm_head``, else the embedding
    (tied; logged as a warning when the config did not say so)."""
    head = top.get("lm_head")
    if head is None:
        if not tie_word_embeddings:
            logging.getLogger("plinth.modelling").warning("%s: the checkpoint has no lm_head: tying it to the embedding", family)
        return embed
    return head


def decoder_weight_bytes(weights: Sequence[Any], *, tables: Sequence[Any], embed: Any, lm_head: Any, per_token: bool) -> int:
    """Bytes a decoder's weights take on the device (each object once); with
    ``per_token``, what one decode step reads: not the rotary ``tables`` nor an
    untied input embedding (a row of each), but a tied head's whole matrix."""
    from plinth.weights import weights_nbytes

    skip = list(tables) if per_token else []
    if per_token and embed is not lm_head:
        skip.append(embed)
    return weights_nbytes(list(weights), skip)


# ---- FP8 checkpoints ----------------------------------------------------------------------

#: the scale tensors' name endings, after ``<weight name without .weight>.``
FP8_SCALE_NAMES = ("weight_scale_inv", "weight_scale")


def fp8_dtypes() -> "tuple[torch.dtype, ...]":
    import torch

    return (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_block_size(hf_config: Mapping[str, Any]) -> tuple[int, int] | None | bool:
    """From ``quantization_config``: False when the checkpoint is not FP8,
    None for per-tensor (or per-channel) scales, (rows, cols) for block
    scales; a ConfigError for another quantization or a malformed block."""
    qcfg = hf_config.get("quantization_config") or {}
    method = str(qcfg.get("quant_method", "")).lower()
    if not method:
        return False
    if method != "fp8":
        raise ConfigError(f"quantization_config quant_method {method!r} is not supported (supported: fp8)")
    block = qcfg.get("weight_block_size")
    if block is None:
        return None
    if len(block) != 2 or not all(int(b) > 0 for b in block):
        raise ConfigError(f"fp8 quantization_config: weight_block_size {block!r} is not [rows, cols]")
    return int(block[0]), int(block[1])


def dequantize_fp8(qw: QuantizedWeight, dtype: "torch.dtype") -> "torch.Tensor":
    """fp8 * scale in float32 on the weight's own device, then ``dtype``:
    one scale, one per output row, or one per ``block_size`` block
    ([ceil(N / bn), ceil(K / bk)], edge blocks cut to the weight)."""
    import torch

    n, k = qw.shape
    q = qw.qweight.to(torch.float32)
    s = qw.scale.to(device=q.device, dtype=torch.float32)
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


def fuse_fp8_rows(parts: Sequence[QuantizedWeight]) -> QuantizedWeight | None:
    """FP8 weights stacked along their output rows (q, k, v; gate, up) as
    one; None when block scales cannot be stacked (a part's rows are not a
    whole number of blocks). Per-tensor scales become per-row ones."""
    import torch

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
    block = parts[0].block_size
    if len(blocks) != 1 or block is None or any(p.shape[0] % block[0] for p in parts[:-1]):
        return None
    return QuantizedWeight(format=parts[0].format, qweight=q, scale=torch.cat([p.scale for p in parts]), shape=(n, k), block_size=block)


def iter_fp8_checkpoint(
    folder: str, block: tuple[int, int] | None, *, device: "torch.device", dtype: "torch.dtype",
    keep: Callable[[str], bool] = lambda name: False, select: Callable[[str], bool] | None = None, progress: bool = False,
    cast_others: bool = True,
) -> Iterator[tuple[str, Any]]:
    """(name, tensor) for every tensor of an FP8 checkpoint but the scales,
    shard by shard (one shard's file open at a time: its mapped pages go
    with it), each moved to ``device`` as stored: an FP8 weight travels in
    FP8 with its scale (from whichever shard holds it) and is dequantized
    there to ``dtype`` (``dequantize_fp8``), or handed on as a
    ``QuantizedWeight`` on ``device`` when ``keep(name)`` (the backend's FP8
    path). Other floating tensors arrive in ``dtype`` (as stored with
    ``cast_others=False``: a model that keeps some in float32). ``select(name)`` skips
    tensors without reading them (another rank's experts). Host memory holds
    one shard's mapping and one tensor at a time, never a dequantized copy."""
    import torch
    from safetensors import safe_open

    from plinth.weights import _progress, safetensors_files

    fp8 = fp8_dtypes()
    files = [str(p) for p in safetensors_files(folder)]
    where: dict[str, str] = {}
    for path in files:
        handle = safe_open(path, framework="pt", device="cpu")
        where.update((name, path) for name in handle.keys())
        del handle

    def wanted(name: str) -> bool:
        if name.rsplit(".", 1)[-1] in (*FP8_SCALE_NAMES, "input_scale"):
            return False
        return select is None or select(name)

    for path in _progress(files, total=len(files), desc=f"Loading {folder}", enabled=progress):
        handle = safe_open(path, framework="pt", device="cpu")
        for name in [n for n in handle.keys() if wanted(n)]:
            tensor = handle.get_tensor(name)
            if tensor.dtype not in fp8:
                cast = cast_others and tensor.is_floating_point()
                yield name, tensor.to(device=device, dtype=dtype if cast else tensor.dtype)
                continue
            base = name.removesuffix(".weight")
            scale_name = next((f"{base}.{s}" for s in FP8_SCALE_NAMES if f"{base}.{s}" in where), None)
            if scale_name is None:
                raise ConfigError(f"FP8 weight {name} has no weight_scale_inv / weight_scale tensor")
            if where[scale_name] == path:
                scale = handle.get_tensor(scale_name)
            else:  # the scale is in another shard: open it for this one read
                other = safe_open(where[scale_name], framework="pt", device="cpu")
                scale = other.get_tensor(scale_name)
                del other
            qw = QuantizedWeight(
                format="fp8_e4m3" if tensor.dtype == torch.float8_e4m3fn else "fp8_e5m2",
                qweight=tensor.to(device),
                scale=scale.to(device=device, dtype=torch.float32),
                shape=(tensor.shape[0], tensor.shape[1]),
                block_size=block if block is not None and scale.dim() == 2 else None,
            )
            del tensor, scale
            yield name, (qw if keep(name) and qw.format == "fp8_e4m3" else dequantize_fp8(qw, dtype))
        del handle


def stack_rows(parts: Sequence[Any]) -> Any:
    """Weights stacked along their output rows: tensors by torch.cat; GGUF
    QuantizedWeights of one type by their rows of blocks; FP8 ones with their
    scales (``fuse_fp8_rows``; a ValueError where block scales cannot stack)."""
    import torch

    if len(parts) == 1:
        return parts[0]
    if not any(isinstance(p, QuantizedWeight) for p in parts):
        return torch.cat(list(parts))
    first = parts[0]
    if not all(isinstance(p, QuantizedWeight) and p.format == first.format and p.shape[1] == first.shape[1] for p in parts):
        raise ValueError("quantized weights fused into one linear must share their format")
    if first.format.startswith("fp8"):
        fused = fuse_fp8_rows(parts)
        if fused is None:
            raise ValueError(f"FP8 parts of {[p.shape for p in parts]} do not align to {first.block_size}-row blocks")
        return fused
    rows = sum(p.shape[0] for p in parts)
    return dataclasses.replace(first, qweight=torch.cat([p.qweight for p in parts]), shape=(rows, first.shape[1]))
