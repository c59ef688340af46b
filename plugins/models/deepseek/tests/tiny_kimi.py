"""A tiny Kimi-K2-style tokenizer folder: ``tiktoken.model`` (ranks of a BPE
trained here on a small English + Chinese text), ``tokenizer_config.json``
as Kimi K2 ships it (``TikTokenTokenizer`` through ``auto_map``, ``[BOS]`` /
``[EOS]``, the named specials in ``added_tokens_decoder`` at the ids after
the ranks) and Kimi K2's chat template in ``chat_template.jinja``.

Kimi K2's real files were not readable from here: the pattern, the special
token names and ids and the template follow ``tokenization_kimi.py`` and
``chat_template.jinja`` as published (the template written from them, the
tool-call part included).
"""

from __future__ import annotations

import base64
import collections
import json
import os

#: ``TikTokenTokenizer.pat_str`` as tokenization_kimi.py writes it (the test's
#: own copy: the reference must not share plinth's)
KIMI_PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
#: 256 reserved ids after the ranks; Kimi K2 names these (its ids: 163584 + offset)
KIMI_SPECIALS = {
    0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>", 6: "<|start_header_id|>",
    7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>", 17: "<|im_middle|>", 18: "<|media_start|>",
    19: "<|media_content|>", 20: "<|media_end|>", 21: "<|media_pad|>", 29: "<|tool_calls_section_begin|>",
    30: "<|tool_calls_section_end|>", 31: "<|tool_call_begin|>", 32: "<|tool_call_argument_begin|>",
    33: "<|tool_call_end|>", 254: "[UNK]", 255: "[PAD]",
}  # fmt: skip

KIMI_CHAT_TEMPLATE = """\
{%- if tools -%}
<|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>
{%- endif -%}
{%- for message in messages -%}
{%- if loop.first and messages[0]['role'] != 'system' -%}
<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>
{%- endif -%}
{%- set role_name = message.get('name') or message['role'] -%}
{%- if message['role'] == 'user' -%}
<|im_user|>{{ role_name }}<|im_middle|>
{%- elif message['role'] == 'assistant' -%}
<|im_assistant|>{{ role_name }}<|im_middle|>
{%- else -%}
<|im_system|>{{ role_name }}<|im_middle|>
{%- endif -%}
{%- if message['role'] == 'assistant' and message.get('tool_calls') -%}
{%- if message['content'] -%}{{ message['content'] }}{%- endif -%}
<|tool_calls_section_begin|>
{%- for tool_call in message['tool_calls'] -%}
<|tool_call_begin|>{{ tool_call['id'] }}<|tool_call_argument_begin|>
{%- if tool_call['function']['arguments'] is string -%}{{ tool_call['function']['arguments'] }}
{%- else -%}{{ tool_call['function']['arguments'] | tojson }}{%- endif -%}
<|tool_call_end|>
{%- endfor -%}
<|tool_calls_section_end|>
{%- elif message['role'] == 'tool' -%}
## Return of {{ message.tool_call_id }}
{{ message['content'] }}
{%- elif message['content'] is string -%}
{{ message['content'] }}
{%- elif message['content'] is not none -%}
{%- for content in message['content'] -%}
{%- if content['type'] == 'image' or 'image' in content or 'image_url' in content -%}
<|media_start|>image<|media_content|><|media_pad|><|media_end|>
{%- else -%}
{{ content['text'] }}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
<|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_assistant|>assistant<|im_middle|>
{%- endif -%}"""

CORPUS = (
    "The quick brown fox jumps over the lazy dog. The dog didn't care; they'll see what's there. "
    "Hello world! Hello there, Kimi. Numbers: 12345 and 2026, 3.14159. "
    "中文分词测试：你好世界，北京是中国的首都。Kimi 是月之暗面的模型。 "
    "def main():\n    return 42\n\n"
) * 3


def train_ranks(text: str, merges: int = 120) -> dict[bytes, int]:
    """Byte-level BPE ranks: the 256 bytes, then ``merges`` merges of the
    most frequent adjacent pair within space-split words."""
    ranks = {bytes([b]): b for b in range(256)}
    words = collections.Counter(tuple(bytes([b]) for b in w.encode()) for w in text.split(" ") if w)
    for _ in range(merges):
        pairs: collections.Counter = collections.Counter()
        for word, n in words.items():
            for a, b in zip(word, word[1:]):
                pairs[a, b] += n
        if not pairs:
            break
        (a, b), _ = pairs.most_common(1)[0]
        ranks[a + b] = len(ranks)
        merged = collections.Counter()
        for word, n in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += n
        words = merged
    return ranks


def write_kimi_tokenizer(path: str) -> dict[bytes, int]:
    """Write the folder's tokenizer files; returns the ranks."""
    os.makedirs(path, exist_ok=True)
    ranks = train_ranks(CORPUS)
    with open(os.path.join(path, "tiktoken.model"), "w") as f:
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(f"{base64.b64encode(token).decode()} {rank}\n")
    first = len(ranks)
    added = {
        str(first + i): {"content": tok, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
        for i, tok in KIMI_SPECIALS.items()
    }
    config = {
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>", "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>"],
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]",
        "clean_up_tokenization_spaces": False,
        "eos_token": "[EOS]",
        "extra_special_tokens": {},
        "model_max_length": 1000000000000000019884624838656,
        "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer",
        "unk_token": "[UNK]",
    }
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write(KIMI_CHAT_TEMPLATE)
    # the code Kimi ships beside its files: plinth must never import or run it
    with open(os.path.join(path, "tokenization_kimi.py"), "w") as f:
        f.write('raise RuntimeError("plinth ran the checkpoint\'s tokenizer code")\n')
    return ranks
