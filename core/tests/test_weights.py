"""plinth.weights: safetensors folders, pickle refusal, GGUF metadata and dequantization."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from plinth.errors import ConfigError
from plinth.weights import GGUFFile, dequantize_gguf, iter_safetensors, load_hf_config, safetensors_files


def _save(path, tensors):
    from safetensors.torch import save_file

    save_file(tensors, str(path))


def test_unsharded_folder_casts_and_selects(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["X"]}))
    _save(tmp_path / "model.safetensors", {"a": torch.randn(3, 4), "ids": torch.arange(5)})
    assert load_hf_config(tmp_path)["architectures"] == ["X"]
    got = dict(iter_safetensors(tmp_path, dtype=torch.bfloat16, progress=False))
    assert got["a"].dtype == torch.bfloat16 and got["ids"].dtype == torch.int64  # ints are never cast
    only = dict(iter_safetensors(tmp_path, progress=False, select=lambda n: n == "a"))
    assert list(only) == ["a"]


def test_sharded_folder_follows_the_index(tmp_path):
    _save(tmp_path / "model-00001-of-00002.safetensors", {"a": torch.ones(2)})
    _save(tmp_path / "model-00002-of-00002.safetensors", {"b": torch.zeros(2)})
    _save(tmp_path / "stray.safetensors", {"c": torch.zeros(1)})  # not in the index: not read
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert [p.name for p in safetensors_files(tmp_path)] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert sorted(n for n, _ in iter_safetensors(tmp_path, progress=False)) == ["a", "b"]


def test_missing_shard_is_named(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "gone.safetensors"}}))
    with pytest.raises(ConfigError, match="gone.safetensors"):
        safetensors_files(tmp_path)


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "weights.pth"])
def test_pickle_checkpoints_are_refused(tmp_path, name):
    torch.save({"a": torch.ones(1)}, tmp_path / name)
    with pytest.raises(ConfigError) as err:
        list(iter_safetensors(tmp_path, progress=False))
    assert name in str(err.value) and "pickle is unsafe" in str(err.value) and "safetensors" in str(err.value)


def test_no_weights_at_all(tmp_path):
    with pytest.raises(ConfigError, match="no \\*.safetensors"):
        safetensors_files(tmp_path)


# ---- GGUF --------------------------------------------------------------------------------


def _write_gguf(path, tensors, **metadata):
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_uint32("llama.context_length", 128)
    writer.add_float32("llama.rope.freq_base", 500000.0)
    writer.add_array("tokenizer.ggml.tokens", ["a", "b"])
    writer.add_bool("tokenizer.ggml.add_bos_token", False)
    for key, value in metadata.items():
        writer.add_string(key, value)
    for name, (array, qtype) in tensors.items():
        if qtype is None:
            writer.add_tensor(name, array)
        else:
            q = gguf.quants.quantize(array, qtype)
            writer.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_metadata_and_tensors(tmp_path):
    import gguf

    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 96)).astype(np.float32)
    tensors = {
        "f32.weight": (w, None),
        "f16.weight": (w.astype(np.float16), None),
        "q8.weight": (w, gguf.GGMLQuantizationType.Q8_0),
        "q4_0.weight": (w, gguf.GGMLQuantizationType.Q4_0),
        "q4_1.weight": (w, gguf.GGMLQuantizationType.Q4_1),
        "q5_0.weight": (w, gguf.GGMLQuantizationType.Q5_0),
        "norm.weight": (w[0].copy(), None),
    }
    path = tmp_path / "m.gguf"
    _write_gguf(path, tensors, **{"general.name": "tiny"})
    f = GGUFFile(path)
    assert f.architecture == "llama" and f.get("general.name") == "tiny"
    assert f.arch_get("block_count") == 2 and f.arch_get("context_length") == 128
    assert f.arch_get("rope.freq_base") == 500000.0 and f.get("tokenizer.ggml.tokens") == ["a", "b"]
    assert f.get("tokenizer.ggml.add_bos_token") is False and f.get("missing", 7) == 7
    with pytest.raises(ConfigError, match="missing"):
        f.require("missing")
    assert f.tensor_shape("q8.weight") == (64, 96) and f.tensor_type("q4_1.weight") == "Q4_1"
    torch.testing.assert_close(f.tensor("f32.weight"), torch.from_numpy(w))
    torch.testing.assert_close(f.tensor("f16.weight"), torch.from_numpy(w.astype(np.float16).astype(np.float32)))
    assert f.tensor("norm.weight").shape == (96,)
    for name in ("q8.weight", "q4_0.weight", "q4_1.weight", "q5_0.weight"):
        raw = f._tensors[name]
        expected = torch.from_numpy(gguf.quants.dequantize(raw.data, raw.tensor_type).reshape(64, 96).copy())
        assert torch.equal(f.tensor(name), expected), name  # bit-identical to gguf's numpy reference
        assert (f.tensor(name) - torch.from_numpy(w)).abs().max() < 0.5  # and close to the original
    assert f.tensor("q4_1.weight", torch.bfloat16).dtype == torch.bfloat16
    names = [n for n, _ in f.iter_tensors(progress=False, select=lambda n: n.startswith("q"))]
    assert names == ["q8.weight", "q4_0.weight", "q4_1.weight", "q5_0.weight"]


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q4_1", "Q8_0"])
def test_dequantize_block_formats_match_gguf(qtype):
    """Random block bytes (with sane fp16 scales) through our dequantizer and
    gguf.quants' numpy reference."""
    import gguf

    t = gguf.GGMLQuantizationType[qtype]
    block_size, type_size = gguf.GGML_QUANT_SIZES[t]
    rows, blocks_per_row = 3, 2
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, size=(rows, blocks_per_row * type_size), dtype=np.uint8)
    # every fp16 scale field gets a small finite value, so no NaN/inf appears
    fp16_offsets = {"Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "Q4_1": [0, 2], "Q8_0": [0]}
    blocks = raw.reshape(-1, type_size)
    for offset in fp16_offsets[qtype]:
        blocks[:, offset : offset + 2] = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    expected = gguf.quants.dequantize(raw, t)
    got = dequantize_gguf(raw, t)
    assert got.shape == (rows, blocks_per_row * block_size)
    assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(expected)).reshape(got.shape))


def test_gguf_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        GGUFFile(tmp_path / "nope.gguf")
