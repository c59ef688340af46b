"""Kimi K2's tokenizer as its checkpoints ship it (``tiktoken.model`` and
``tokenizer_config.json``, with ``tokenization_kimi.py`` beside them, never
run): plinth's ``Tokenizer.from_hf_dir`` encodes as the ``tiktoken`` package
does over the same ranks, pattern and specials, decodes back to the text,
and renders Kimi K2's chat template into the tokens it names."""

from __future__ import annotations

import pytest
from plinth.api import ConfigError, Tokenizer
from tiny_kimi import KIMI_PAT_STR, KIMI_SPECIALS, write_kimi_tokenizer

TEXTS = [
    "Hello world! The quick brown fox didn't jump; they'll see.",
    "中文分词测试：你好世界，北京是中国的首都。Kimi 是月之暗面的模型。",
    "中文English混合 and ÀÉÎ Ünïcödé, emoji 🙂🚀 too",
    "Numbers 1234567890 and 3.14159, x=42;",
    "def main():\n    return 42\n\n\n   trailing spaces   \t\r\n",
    "HELLO World CamelCaseWords THE'S I'M",
    "",
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("kimi"))
    return path, write_kimi_tokenizer(path)


def reference(ranks):
    """What Kimi's TikTokenTokenizer builds: tiktoken over the ranks, its
    pat_str, specials at the ids after the ranks."""
    import tiktoken

    specials = {KIMI_SPECIALS.get(i, f"<|reserved_token_{len(ranks) + i}|>"): len(ranks) + i for i in range(256)}
    return tiktoken.Encoding(name="kimi-tiny", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens=specials)


def test_encodes_as_tiktoken_and_round_trips(folder):
    path, ranks = folder
    tok = Tokenizer.from_hf_dir(path)
    ref = reference(ranks)
    assert tok.vocab_size == ref.n_vocab == len(ranks) + 256
    merged = 0
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text, allowed_special="all"), text
        assert tok.decode(ids) == text
        merged += sum(i >= 256 for i in ids)
    assert merged > 20  # the merges were used, not only single bytes
    # a special token in the text is one token, as Kimi's encode allows them
    text = "<|im_user|>user<|im_middle|>你好<|im_end|>"
    ids = tok.encode(text)
    assert ids == ref.encode(text, allowed_special="all")
    assert ids[0] == len(ranks) + 3 and ids[-1] == len(ranks) + 2
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == "user你好"


def test_special_ids_bos_eos_and_no_bos_added(folder):
    path, ranks = folder
    tok = Tokenizer.from_hf_dir(path)
    base = len(ranks)
    assert tok.bos_token_id == base and tok.token_to_id("[EOS]") == base + 1
    # [EOS], and <|im_end|>: the end of a turn the chat template writes
    assert set(tok.eos_token_ids) == {base + 1, base + 2}
    assert tok.token_to_id(f"<|reserved_token_{base + 5}|>") == base + 5
    assert tok.token_to_id("[PAD]") == base + 255
    assert {base, base + 1, base + 2, base + 255} <= tok.special_token_ids
    assert tok.encode("Hello") == tok.encode("Hello", add_special_tokens=False)  # Kimi adds no BOS
    assert tok.vocab_type == "byte_level"


def test_chat_template(folder):
    path, _ = folder
    tok = Tokenizer.from_hf_dir(path)
    text = tok.apply_chat_template([{"role": "user", "content": "你好"}, {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "2+2?"}])
    assert text == (
        "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
        "<|im_user|>user<|im_middle|>你好<|im_end|><|im_assistant|>assistant<|im_middle|>Hi!<|im_end|>"
        "<|im_user|>user<|im_middle|>2+2?<|im_end|><|im_assistant|>assistant<|im_middle|>"
    )
    ids = tok.encode(text, add_special_tokens=False)
    for marker in ("<|im_system|>", "<|im_middle|>", "<|im_user|>", "<|im_assistant|>", "<|im_end|>"):
        assert tok.token_to_id(marker) in ids
    assert tok.decode(ids, skip_special_tokens=False) == text
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}], tools=tools)
    assert text.startswith('<|im_system|>tool_declare<|im_middle|>[{"type":"function","function":{"name":"get_weather"')
    assert "<|im_system|>system<|im_middle|>Be brief.<|im_end|>" in text and "You are Kimi" not in text


def test_unknown_tiktoken_module_is_refused(tmp_path):
    import json

    path = str(tmp_path)
    write_kimi_tokenizer(path)
    with open(f"{path}/tokenizer_config.json") as f:
        config = json.load(f)
    config["auto_map"] = {"AutoTokenizer": ["tokenization_other.OtherTokenizer", None]}
    with open(f"{path}/tokenizer_config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(ConfigError, match="tokenization_other.*not known"):
        Tokenizer.from_hf_dir(path)
