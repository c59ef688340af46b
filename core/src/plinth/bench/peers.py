"""Peers measured beside plinth on the same weights."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

#: llama.cpp's Python binding, the peer on GGUF files (benchmarks, the gemma
#: tests): PyPI has only its sdist, so it builds for the CPU it runs on
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"


def llama_cpp_cmake_args(machine: str | None = None) -> str:
    """CMAKE_ARGS for building llama.cpp here: native instructions, no
    multimodal library (127 compile units instead of 178), and on x86 no
    ggml AMX path: built with it, 0.3.36 dies of SIGILL at its first tile
    instruction (``tilezero`` in ``ggml_backend_amx_mul_mat``, a worker
    thread) on an Intel Xeon with AMX, seen here; upstream's fix is open
    (ggml-org/llama.cpp#26954). Its code needs ``__AMX_INT8__``, which
    ``-mno-amx-int8`` clears whatever ``-march=native`` says."""
    args = ["-DGGML_NATIVE=ON", "-DLLAVA_BUILD=OFF"]
    if (machine or platform.machine()).lower() in ("x86_64", "amd64"):
        args += ["-DCMAKE_C_FLAGS=-mno-amx-int8", "-DCMAKE_CXX_FLAGS=-mno-amx-int8"]
    return " ".join(args)


def install_llama_cpp(python: str = sys.executable) -> None:
    """Build and install ``LLAMA_CPP_PYTHON`` into ``python``'s environment
    (about 5 minutes on 2 quiet cores); never from pip's cache, which may
    hold a build for another CPU."""
    env = dict(os.environ, CMAKE_ARGS=llama_cpp_cmake_args())
    subprocess.run([python, "-m", "pip", "install", "--no-cache-dir", LLAMA_CPP_PYTHON], check=True, env=env)


def gguf_to_hf_folder(gguf: str | Path, out: str | Path) -> None:
    """A plain Hugging Face folder (float32 safetensors + tokenizer) holding a
    GGUF model's dequantized weights. transformers 5.x keeps a GGUF model's
    weights quantized (and its serve command does not take GGUF files at
    all), so a fair bfloat16 peer is rebuilt from this folder."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(gguf)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    cfg = copy.deepcopy(quantized.config)
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(cfg, attr):
            delattr(cfg, attr)
    cfg.architectures = [type(quantized).__name__]
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), strict=True)  # the state dict holds dequantized tensors
    model.generation_config = quantized.generation_config
    model.save_pretrained(out)
    tok.save_pretrained(out)


def batch1_prompt(vocab_size: int, seed: int = 0, n: int = 16) -> list[int]:
    """The prompt `platform bench offline` times batch-1 decode after
    (``time_decode_steps``: ``n`` token ids drawn from ``random.Random(seed)``)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(200, vocab_size) for _ in range(n)]


def llamacpp_batch1_ms(gguf: str | Path, prompt: list[int], steps: int, threads: int, repeats: int = 1) -> list[float]:
    """llama.cpp (``llama-cpp-python``) batch-1 greedy decode on a GGUF file:
    per repeat, the median ms of one decode step (sample, then evaluate the
    token) over ``steps`` steps after the prompt, as ``platform bench offline``
    times plinth's (median of its steps). Imports only ``llama_cpp``, so this
    module also runs as a script with another environment's Python:
    ``python peers.py llamacpp-batch1 '{"gguf": ..., "prompt": [...], "steps": 64, "threads": 2}'``."""
    import statistics
    import time

    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=2048, n_threads=threads, n_batch=512, verbose=False)
    out = []
    for _ in range(repeats):
        llm.reset()
        llm.eval(prompt)
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            tok = llm.sample(temp=0.0)
            llm.eval([tok])
            times.append(time.perf_counter() - t)
        out.append(statistics.median(times) * 1000)
    return out


if __name__ == "__main__":  # llama.cpp from another venv (bench/serve_compare.py --llamacpp-venv); `make setup-peers`
    import json

    if sys.argv[1:] == ["install-llamacpp"]:
        install_llama_cpp()
        sys.exit(0)
    if len(sys.argv) != 3 or sys.argv[1] != "llamacpp-batch1":
        sys.exit("usage: peers.py llamacpp-batch1 JSON | install-llamacpp")
    spec = json.loads(sys.argv[2])
    ms = llamacpp_batch1_ms(spec["gguf"], spec["prompt"], spec["steps"], spec["threads"], spec.get("repeats", 1))
    import llama_cpp

    print(json.dumps({"ms_per_token": ms, "llama_cpp": getattr(llama_cpp, "__version__", "?")}))
