"""Reading model weights and metadata, for model plugins.

Two sources: a Hugging Face folder (``config.json`` + ``*.safetensors``,
sharded with ``model.safetensors.index.json`` or not) and a GGUF file (read
with the ``gguf`` package; quantized tensors are dequantized with numpy, then
handed over as torch tensors in the dtype asked for).

Pickle checkpoints (``*.bin``, ``*.pt``, ``*.pth``, ...) are refused: loading
one can run arbitrary code.

torch is imported inside the functions that return tensors, so importing this
module stays cheap.
"""

from __future__ import annotations

import functools
import json
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, cast

from plinth.errors import ConfigError

if TYPE_CHECKING:
    import numpy as np
    import torch

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
SAFETENSORS_INDEX = "model.safetensors.index.json"


def _progress(items: Iterable[Any], *, total: int, desc: str, enabled: bool) -> Iterable[Any]:
    if not enabled:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, total=total, desc=desc, unit="tensor", leave=False, dynamic_ncols=True)


# --------------------------------------------------------------------------
# Hugging Face folders
# --------------------------------------------------------------------------


def load_hf_config(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """``config.json`` of a model folder, as a dict."""
    path = Path(folder) / "config.json"
    if not path.exists():
        raise ConfigError(f"{folder}: no config.json")
    with open(path) as f:
        return json.load(f)


def pickle_error(path: str | os.PathLike[str]) -> ConfigError:
    return ConfigError(
        f"{path}: refusing to load a pickle checkpoint: pickle is unsafe (loading it can run arbitrary code). "
        "Convert it to safetensors first, e.g. with transformers: "
        "AutoModelForCausalLM.from_pretrained(folder).save_pretrained(out, safe_serialization=True)"
    )


def safetensors_files(folder: str | os.PathLike[str]) -> list[Path]:
    """The safetensors files holding a model folder's weights, in order.

    Uses ``model.safetensors.index.json`` when present (sharded checkpoints),
    else every ``*.safetensors`` file. A folder with only pickle checkpoints
    raises ``ConfigError`` naming the file.
    """
    folder = Path(folder)
    index = folder / SAFETENSORS_INDEX
    if index.exists():
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
        missing = [str(p) for p in files if not p.exists()]
        if missing:
            raise ConfigError(f"{index} names shards that are missing: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise pickle_error(pickles[0])
    raise ConfigError(f"{folder}: no *.safetensors weights found")


def iter_safetensors(
    folder: str | os.PathLike[str],
    *,
    dtype: "torch.dtype | None" = None,
    device: "str | torch.device" = "cpu",
    progress: bool = True,
    select: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, "torch.Tensor"]]:
    """Yield (name, tensor) for every tensor of a folder's safetensors files,
    cast to ``dtype`` when given (float tensors only). ``select(name)`` skips
    the tensors it rejects without reading them. Shows a progress bar."""
    import torch
    from safetensors import safe_open

    files = safetensors_files(folder)
    handles = []
    names: list[tuple[int, str]] = []
    try:
        for i, path in enumerate(files):
            handle = safe_open(str(path), framework="pt", device="cpu")
            handles.append(handle)
            names.extend((i, n) for n in handle.keys() if select is None or select(n))
        desc = f"Loading {Path(folder).name}"
        for i, name in _progress(names, total=len(names), desc=desc, enabled=progress):
            tensor = handles[i].get_tensor(name)
            if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
                tensor = tensor.to(dtype)
            if torch.device(device).type != "cpu":
                tensor = tensor.to(device)
            yield name, tensor
    finally:
        handles.clear()


# --------------------------------------------------------------------------
# GGUF files
# --------------------------------------------------------------------------

#: quantization types this module dequantizes (with gguf.quants)
GGUF_DEQUANTIZABLE = ("F32", "F16", "BF16", "F64", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def _dequantize_torch(data: "np.ndarray", name: str) -> "torch.Tensor | None":
    """Q4_0 / Q4_1 / Q8_0 in torch (multithreaded), with the same float32
    arithmetic as gguf.quants, so the results are bit-identical; None for
    other types."""
    import numpy as np
    import torch

    layouts = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}  # bytes per block of 32 weights
    if name not in layouts:
        return None
    with warnings.catch_warnings():  # read-only memory map: we only read it
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8)).reshape(-1, layouts[name])
    rows = data.shape[0] if data.ndim > 1 else 1
    d = raw[:, 0:2].contiguous().view(torch.float16).to(torch.float32)  # [blocks, 1]
    if name == "Q8_0":
        q = raw[:, 2:].contiguous().view(torch.int8).to(torch.float32)
        out = q * d
    else:
        packed = raw[:, -16:]
        q = torch.cat((packed & 0x0F, packed >> 4), dim=1)  # low nibbles are weights 0..15
        if name == "Q4_0":
            out = d * (q.to(torch.int8) - 8).to(torch.float32)
        else:
            m = raw[:, 2:4].contiguous().view(torch.float16).to(torch.float32)
            out = d * q.to(torch.float32) + m
    return out.reshape(rows, -1)


def dequantize_gguf(data: "np.ndarray", qtype: Any, dtype: "torch.dtype | None" = None) -> "torch.Tensor":
    """A GGUF tensor's raw data (as ``ReaderTensor.data``) as a torch tensor
    of its logical shape, rows first (a weight comes out [out, in], as in
    Hugging Face checkpoints), in ``dtype`` (default float32)."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType(qtype)
    fast = _dequantize_torch(data, qtype.name)
    if fast is not None:
        return fast.to(dtype or torch.float32)
    try:
        array = quants.dequantize(data, qtype)
    except NotImplementedError as exc:
        raise ConfigError(
            f"GGUF tensor type {qtype.name} cannot be dequantized here (known to work: {', '.join(GGUF_DEQUANTIZABLE)})"
        ) from exc
    array = np.ascontiguousarray(array)
    if not array.flags.writeable:  # a view of the read-only memory map
        array = array.copy()
    return torch.from_numpy(array).to(dtype or torch.float32)


@functools.lru_cache(maxsize=4)
def _reader(path: str, mtime_ns: int) -> Any:
    from gguf import GGUFReader

    return GGUFReader(path)


class GGUFFile:
    """A GGUF file: its metadata as Python values and its tensors as torch tensors.

    Opening parses the metadata once per process and file (the tokenizer, the
    config and the weights all read the same file); tensor data is memory-mapped.
    """

    def __init__(self, path_or_reader: Any) -> None:
        if isinstance(path_or_reader, (str, os.PathLike)):
            self.path = os.fspath(path_or_reader)
            if not os.path.exists(self.path):
                raise ConfigError(f"GGUF file not found: {self.path}")
            self.reader = _reader(os.path.abspath(self.path), os.stat(self.path).st_mtime_ns)
        else:
            self.reader = path_or_reader
            self.path = str(getattr(path_or_reader, "path", "<gguf>"))
        self._tensors = {t.name: t for t in self.reader.tensors}

    # ---- metadata ----------------------------------------------------------------

    @property
    def architecture(self) -> str:
        arch = self.get("general.architecture")
        if not arch:
            raise ConfigError(f"{self.path}: GGUF metadata has no general.architecture")
        return arch

    def keys(self) -> list[str]:
        return list(self.reader.fields)

    def __contains__(self, key: str) -> bool:
        return key in self.reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value as a Python str / int / float / bool / list."""
        field = self.reader.fields.get(key)
        if field is None:
            return default
        value = field.contents()
        if hasattr(value, "tolist"):  # numpy scalars
            value = value.tolist()
        return value

    def arch_get(self, suffix: str, default: Any = None) -> Any:
        """``{architecture}.{suffix}``, e.g. arch_get("block_count")."""
        return self.get(f"{self.architecture}.{suffix}", default)

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ConfigError(f"{self.path}: GGUF metadata has no {key}")
        return value

    # ---- tensors -------------------------------------------------------------------

    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def tensor_type(self, name: str) -> str:
        return self._tensors[name].tensor_type.name

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """Logical shape, rows first ([out, in] for a weight)."""
        return tuple(int(d) for d in reversed(self._tensors[name].shape))

    def tensor(self, name: str, dtype: "torch.dtype | None" = None) -> "torch.Tensor":
        """One tensor, dequantized, rows first, in ``dtype`` (default float32)."""
        if name not in self._tensors:
            raise ConfigError(f"{self.path}: no tensor {name!r}")
        t = self._tensors[name]
        out = dequantize_gguf(t.data, t.tensor_type, dtype)
        return out.reshape(self.tensor_shape(name))

    def quantized_weight(self, name: str) -> Any:
        """A 2-D weight as stored, not dequantized: a ``QuantizedWeight`` of
        format ``gguf_<type>`` (``gguf_q4_1``), qweight its rows of blocks as
        uint8 [out, in / block * bytes per block] (a view of the memory map,
        read-only: copy before writing), no separate scale (the scales live in
        the blocks), block_size (1, weights per block)."""
        import numpy as np
        import torch
        from gguf import GGML_QUANT_SIZES

        from plinth.contract import QuantizedWeight

        if name not in self._tensors:
            raise ConfigError(f"{self.path}: no tensor {name!r}")
        t = self._tensors[name]
        shape = self.tensor_shape(name)
        if len(shape) != 2:
            raise ConfigError(f"{self.path}: {name} is not a matrix ({shape})")
        block, nbytes = GGML_QUANT_SIZES[t.tensor_type]
        with warnings.catch_warnings():  # read-only memory map: the kernels only read it
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(np.ascontiguousarray(t.data).view(np.uint8)).reshape(shape[0], shape[1] // block * nbytes)
        return QuantizedWeight(format=f"gguf_{t.tensor_type.name.lower()}", qweight=raw, scale=torch.empty(0), shape=(shape[0], shape[1]), block_size=(1, block))

    def iter_tensors(
        self,
        *,
        dtype: "torch.dtype | None" = None,
        progress: bool = True,
        select: Callable[[str], bool] | None = None,
    ) -> Iterator[tuple[str, "torch.Tensor"]]:
        """Yield (name, tensor) for every tensor (or those ``select`` keeps),
        dequantized, with a progress bar."""
        names = [n for n in self._tensors if select is None or select(n)]
        desc = f"Loading {os.path.basename(self.path)}"
        for name in _progress(names, total=len(names), desc=desc, enabled=progress):
            yield name, self.tensor(name, dtype)


def weights_nbytes(weights: Iterable[Any], skip: Iterable[Any] = ()) -> int:
    """Bytes ``weights`` take, each object counted once and those in ``skip``
    not at all: tensors by their elements, a backend's packed weight by its
    ``nbytes`` (an attribute or a method). A model's ``weight_bytes()``."""
    seen = {id(w) for w in skip}
    total = 0
    for w in weights:
        if id(w) in seen:
            continue
        seen.add(id(w))
        if hasattr(w, "element_size") and hasattr(w, "numel"):  # a tensor (no torch import here)
            total += w.numel() * w.element_size()
        else:
            size = getattr(w, "nbytes", 0)
            total += int(cast(Any, size)() if callable(size) else size)
    return total
