"""Tokenizers and chat templates, for model plugins and the engine.

``Tokenizer`` wraps a ``tokenizers.Tokenizer`` (the Rust fast tokenizer) with
what serving needs: special token ids, end-of-turn ids, the chat template
rendered in a sandboxed jinja2 environment with the Hugging Face extras, and
the vocabulary in the form structured-output libraries (xgrammar) take.

Two constructors: ``from_hf_dir`` (tokenizer.json + tokenizer_config.json,
chat_template.jinja, generation_config.json; or, for checkpoints that ship a
tiktoken rank file with Python code to read it, such as Kimi K2, the
``tiktoken.model`` converted to the same fast tokenizer without running that
code) and ``from_gguf`` (a tokenizer rebuilt from GGUF metadata: byte-level
BPE for ``tokenizer.ggml.model == "gpt2"``, SentencePiece-style BPE with
byte fallback for ``"llama"``).
"""

from __future__ import annotations

import json
import logging
import os
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from plinth.errors import ConfigError

log = logging.getLogger("plinth.tokenizer")

#: end-of-turn tokens of common chat formats; one counts as a stop token when
#: the model's chat template writes it
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|end_of_turn|>")

# GGUF token types (llama.cpp)
_GGUF_CONTROL = 3
_GGUF_USER_DEFINED = 4

# Pre-tokenizer splits by tokenizer.ggml.pre, as llama.cpp applies them
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
#: Kimi K2's (``tokenization_kimi.py`` ``TikTokenTokenizer.pat_str``): GPT-4o's
#: letters with Han split out into runs of its own
_KIMI_K2_SPLIT = (
    r"[\p{Han}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DIGITS = "digits"  # each digit alone, then the GPT-2 split
GGUF_PRE_TOKENIZERS: dict[str, str] = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "smaug-bpe", "dbrx"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"), _DIGITS),
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), _GPT4O_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    "kimi-k2": _KIMI_K2_SPLIT,
    **dict.fromkeys(("default", "gpt-2", "gpt2", "phi-2", "jina-es", "jina-de", "olmo"), _GPT2_SPLIT),
}


#: tiktoken rank files (``tiktoken.model``) come with Python code that holds
#: the split pattern and the number of special-token ids after the ranks; by
#: the module ``tokenizer_config.json``'s ``auto_map`` names: (split, specials)
TIKTOKEN_TOKENIZERS: dict[str, tuple[str, int]] = {
    "tokenization_kimi": (_KIMI_K2_SPLIT, 256),
}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE vocabularies)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


class Tokenizer:
    """A fast tokenizer with special tokens, stop ids and the chat template.

    Attributes: ``vocab_size`` (with added tokens), ``bos_token_id``,
    ``eos_token_ids`` (eos plus the chat format's end-of-turn token),
    ``special_token_ids``, ``chat_template``, ``vocab_type`` ("byte_level",
    "byte_fallback" or "raw", for xgrammar) and ``add_prefix_space``.
    """

    def __init__(
        self,
        backend: Any,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
        special_tokens: Mapping[str, str | None] | None = None,
        vocab_type: str = "raw",
        add_prefix_space: bool = False,
        name: str = "",
    ) -> None:
        self.backend = backend
        self.name = name
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.chat_template = chat_template
        self.vocab_type = vocab_type
        self.add_prefix_space = add_prefix_space
        #: bos_token / eos_token / unk_token / pad_token as strings, for templates
        self.special_tokens: dict[str, str | None] = dict(special_tokens or {})
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.special_token_ids: frozenset[int] = frozenset(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special
        )
        self._template: Any = None

    def __repr__(self) -> str:
        return f"Tokenizer({self.name or 'unnamed'}, vocab_size={self.vocab_size}, eos={self.eos_token_ids})"

    # ---- text <-> ids ------------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. ``add_special_tokens`` adds what the model's
        post-processor adds (a BOS for many); text rendered by the chat
        template usually already has it: encode that with False."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_piece(self, token_id: int) -> str:
        """The vocabulary entry for an id, as the vocabulary spells it
        (byte-level 'Ġthe', SentencePiece '▁the', '<0x0A>')."""
        piece = self.backend.id_to_token(int(token_id))
        if piece is None:
            raise IndexError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        return piece

    def token_to_id(self, piece: str) -> int | None:
        return self.backend.token_to_id(piece)

    def raw_vocab(self) -> list[str]:
        """Every vocabulary entry in id order, spelled as in the vocabulary
        (what ``xgrammar.TokenizerInfo(encoded_vocab, vocab_type)`` expects)."""
        out = [""] * self.vocab_size
        for piece, i in self.backend.get_vocab(with_added_tokens=True).items():
            if 0 <= i < len(out):
                out[i] = piece
        return out

    # ---- chat ----------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render a conversation with the model's chat template.

        messages: dicts with ``role`` and ``content``; content is a string or
        a list of ``{"type": "text", "text": ...}`` parts (joined into one
        string; other part types are kept for templates that read them).
        Keys whose value is None are dropped (as transformers does). Extra
        keyword arguments reach the template (``enable_thinking=False``...).
        """
        if not self.chat_template:
            raise ConfigError(f"{self.name or 'this tokenizer'} has no chat template")
        if self._template is None:
            self._template = compile_chat_template(self.chat_template)
        context = {k: v for k, v in self.special_tokens.items() if v is not None}
        context.update(kwargs)
        return self._template.render(
            messages=[normalize_message(m) for m in messages],
            tools=list(tools) if tools is not None else None,
            add_generation_prompt=add_generation_prompt,
            **context,
        )

    # ---- constructors ---------------------------------------------------------------------

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike[str]) -> "Tokenizer":
        """From a Hugging Face model folder: tokenizer.json, plus
        tokenizer_config.json (special tokens, chat template),
        chat_template.jinja / chat_template.json, generation_config.json and
        config.json (eos ids)."""
        from tokenizers import Tokenizer as FastTokenizer

        folder = Path(path)
        tok_file = folder / "tokenizer.json"
        config = _read_json(folder / "tokenizer_config.json")
        if tok_file.exists():
            backend = FastTokenizer.from_file(str(tok_file))
        elif (folder / "tiktoken.model").exists():
            backend = _tiktoken_bpe(folder / "tiktoken.model", config)
        else:
            hint = " (it has only a SentencePiece tokenizer.model: save it with a fast tokenizer)" if (folder / "tokenizer.model").exists() else ""
            raise ConfigError(f"{folder}: no tokenizer.json{hint}")

        template = _hf_chat_template(folder, config)
        special = {
            key: _token_content(config.get(key)) for key in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        bos_id = backend.token_to_id(special["bos_token"]) if special["bos_token"] else None
        eos_ids: list[int] = []
        eos_id = backend.token_to_id(special["eos_token"]) if special["eos_token"] else None
        if eos_id is not None:
            eos_ids.append(eos_id)
        for extra in (_read_json(folder / "generation_config.json"), _read_json(folder / "config.json")):
            eos_ids.extend(_as_list(extra.get("eos_token_id")))
            if bos_id is None and extra.get("bos_token_id") is not None:
                bos_id = _as_list(extra.get("bos_token_id"))[0]
        eos_ids.extend(_end_of_turn_ids(backend, template))

        vocab_type, prefix_space = _vocab_type(json.loads(backend.to_str()))
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_ids=eos_ids,
            chat_template=template,
            special_tokens=special,
            vocab_type=vocab_type,
            add_prefix_space=prefix_space,
            name=folder.name,
        )

    @classmethod
    def from_gguf(cls, path_or_reader: Any) -> "Tokenizer":
        """Rebuilt from a GGUF file's tokenizer metadata (a path, a
        ``gguf.GGUFReader`` or a ``plinth.weights.GGUFFile``)."""
        from plinth.weights import GGUFFile

        gguf = path_or_reader if isinstance(path_or_reader, GGUFFile) else GGUFFile(path_or_reader)
        kind = gguf.get("tokenizer.ggml.model")
        tokens = gguf.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ConfigError(f"{gguf.path}: GGUF metadata has no tokenizer (tokenizer.ggml.tokens)")
        token_types = gguf.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        if kind == "gpt2":
            backend = _byte_level_bpe(tokens, token_types, gguf.get("tokenizer.ggml.merges") or [], gguf.get("tokenizer.ggml.pre"))
            vocab_type, prefix_space = "byte_level", False
            add_bos = bool(gguf.get("tokenizer.ggml.add_bos_token", False))
        elif kind == "llama":
            prefix_space = bool(gguf.get("tokenizer.ggml.add_space_prefix", True))
            backend = _sentencepiece_bpe(tokens, token_types, gguf.get("tokenizer.ggml.scores"), gguf.get("tokenizer.ggml.merges"), prefix_space)
            vocab_type = "byte_fallback"
            add_bos = bool(gguf.get("tokenizer.ggml.add_bos_token", True))
        else:
            raise ConfigError(
                f"{gguf.path}: GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2' byte-level BPE, "
                "'llama' SentencePiece BPE)"
            )

        def token_at(key: str) -> tuple[int | None, str | None]:
            i = gguf.get(f"tokenizer.ggml.{key}")
            if i is None or not 0 <= int(i) < len(tokens):
                return None, None
            return int(i), tokens[int(i)]

        bos_id, bos = token_at("bos_token_id")
        eos_id, eos = token_at("eos_token_id")
        _, unk = token_at("unknown_token_id")
        _, pad = token_at("padding_token_id")
        if add_bos and bos_id is not None:
            from tokenizers import processors

            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
            )
        template = gguf.get("tokenizer.chat_template")
        eos_ids = [eos_id] if eos_id is not None else []
        for key in ("eot_token_id", "eom_token_id"):
            i, _ = token_at(key)
            if i is not None:
                eos_ids.append(i)
        eos_ids.extend(_end_of_turn_ids(backend, template))
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_ids=eos_ids,
            chat_template=template,
            special_tokens={"bos_token": bos, "eos_token": eos, "unk_token": unk, "pad_token": pad},
            vocab_type=vocab_type,
            add_prefix_space=prefix_space,
            name=os.path.basename(gguf.path),
        )


# --------------------------------------------------------------------------
# Building tokenizers from GGUF metadata
# --------------------------------------------------------------------------


def _byte_level_bpe(tokens: list[str], token_types: list[int], merges: list[str], pre: str | None) -> Any:
    from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
    from tokenizers import Tokenizer as FastTokenizer
    from tokenizers.models import BPE

    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    # GGUF stores byte-level tokens already spelled in the byte alphabet; a
    # token with other characters is spelled from its UTF-8 bytes (as transformers does)
    vocab = {
        (tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8"))): i
        for i, tok in enumerate(tokens)
    }
    backend = FastTokenizer(
        BPE(
            vocab=vocab,
            merges=[_merge_pair(m) for m in merges],
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    split = GGUF_PRE_TOKENIZERS.get(pre or "default")
    if split is None:
        log.warning("GGUF pre-tokenizer %r is unknown: using GPT-2's split", pre)
        split = _GPT2_SPLIT
    if split == _GPT2_SPLIT:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif split == _DIGITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        )
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    # control tokens (<|im_end|>...) stay whole and are special; a control token
    # spelled outside the byte alphabet is a llama.cpp mislabel: skipped
    specials = [
        AddedToken(tok, normalized=False, special=True)
        for tok, kind in zip(tokens, token_types)
        if kind == _GGUF_CONTROL and set(tok) <= alphabet
    ]
    backend.add_special_tokens(specials)
    user = [AddedToken(tok, normalized=False, special=False) for tok, kind in zip(tokens, token_types) if kind == _GGUF_USER_DEFINED]
    if user:
        backend.add_tokens(user)
    return backend


# --------------------------------------------------------------------------
# tiktoken rank files, converted to a byte-level BPE
# --------------------------------------------------------------------------


def _tiktoken_bpe(model_file: Path, config: Mapping[str, Any]) -> Any:
    """A fast tokenizer that encodes as ``tiktoken.Encoding`` does over the
    rank file (one ``base64(token bytes) rank`` a line): byte-level BPE whose
    merges are the ranks in order (each token's last merge found by running
    BPE on its own bytes, as transformers' TikTokenConverter does), whole
    pieces found in the vocabulary kept as one token (tiktoken's shortcut,
    ``ignore_merges``), the split pattern the checkpoint's tokenizer module
    holds (``TIKTOKEN_TOKENIZERS``), and special tokens at the ids after the
    ranks: ``added_tokens_decoder``'s names, ``<|reserved_token_{id}|>``
    for the others (Kimi's ``tokenization_kimi.py`` convention)."""
    import base64

    from tokenizers import AddedToken, Regex, decoders, pre_tokenizers
    from tokenizers import Tokenizer as FastTokenizer
    from tokenizers.models import BPE

    auto = (config.get("auto_map") or {}).get("AutoTokenizer") or [None]
    module = str(auto[0] if isinstance(auto, list) else auto).split(".")[0]
    if module not in TIKTOKEN_TOKENIZERS:
        raise ConfigError(
            f"{model_file}: a tiktoken tokenizer from {module!r} (tokenizer_config.json auto_map): its split pattern "
            f"is not known (known: {sorted(TIKTOKEN_TOKENIZERS)}); plinth does not run a checkpoint's code"
        )
    split, num_special = TIKTOKEN_TOKENIZERS[module]
    ranks: dict[bytes, int] = {}
    with open(model_file, "rb") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    token, rank = line.split()
                    ranks[base64.b64decode(token)] = int(rank)
                except ValueError as exc:
                    raise ConfigError(f"{model_file}:{n}: not a 'base64 rank' line") from exc
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ConfigError(f"{model_file}: the ranks are not 0 .. {len(ranks) - 1}, each once")
    if any(bytes([b]) not in ranks for b in range(256)):
        raise ConfigError(f"{model_file}: not every single byte is a token (byte-level BPE needs all 256)")

    spelling = bytes_to_unicode()

    def spell(token: bytes) -> str:
        return "".join(spelling[b] for b in token)

    merges: list[tuple[str, str]] = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) > 1:
            parts = _bpe_parts(ranks, token, rank)
            if len(parts) != 2:
                raise ConfigError(f"{model_file}: token {token!r} (rank {rank}) is not one merge of two lower-ranked tokens")
            merges.append((spell(parts[0]), spell(parts[1])))
    backend = FastTokenizer(BPE(vocab={spell(t): r for t, r in ranks.items()}, merges=merges, ignore_merges=True, fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    named = {int(i): _token_content(tok) for i, tok in (config.get("added_tokens_decoder") or {}).items()}
    first = len(ranks)
    specials = [named.get(i) or f"<|reserved_token_{i}|>" for i in range(first, first + num_special)]
    backend.add_special_tokens([AddedToken(tok, normalized=False, special=True) for tok in specials])
    for i, tok in enumerate(specials, first):
        if backend.token_to_id(tok) != i:
            raise ConfigError(f"{model_file}: special token {tok!r} should have id {i}, got {backend.token_to_id(tok)}")
    return backend


def _bpe_parts(ranks: Mapping[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """``token``'s bytes merged as tiktoken would, stopping before rank
    ``max_rank`` (the token's own): its two halves when it is a merge."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 1:
        best, best_rank = -1, max_rank
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < best_rank:
                best, best_rank = i, r
        if best < 0:
            break
        parts[best : best + 2] = [parts[best] + parts[best + 1]]
    return parts


def _merge_pair(merge: str) -> tuple[str, str]:
    """A merges-list entry ("a b") as the pair BPE takes."""
    left, _, right = merge.partition(" ")
    return left, right


def _sentencepiece_merges(tokens: list[str], scores: list[float] | None) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a
    token into two tokens, best score first (transformers' generate_merges)."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    ranked = dict(zip(tokens, scores)) if scores is not None else vocab
    merges = []
    for merge, score in ranked.items():
        local = [
            (merge[:k], merge[k:], score) for k in range(1, len(merge)) if merge[:k] in vocab and merge[k:] in vocab
        ]
        local.sort(key=lambda x: (vocab[x[0]], vocab[x[1]]))
        merges.extend(local)
    merges.sort(key=lambda v: (v[2], len(v[0]), len(v[1])), reverse=scores is not None)
    return [(a, b) for a, b, _ in merges]


def _sentencepiece_bpe(
    tokens: list[str], token_types: list[int], scores: list[float] | None, merges: list[str] | None, prefix_space: bool
) -> Any:
    from tokenizers import AddedToken, decoders, pre_tokenizers
    from tokenizers import Tokenizer as FastTokenizer
    from tokenizers.models import BPE

    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [_merge_pair(m) for m in merges] if merges else _sentencepiece_merges(tokens, scores)
    backend = FastTokenizer(BPE(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True, dropout=None))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix_space else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix_space:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    specials = [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, token_types) if k == _GGUF_CONTROL]
    backend.add_special_tokens(specials)
    user = [AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, token_types) if k == _GGUF_USER_DEFINED]
    if user:
        backend.add_tokens(user)
    return backend


# --------------------------------------------------------------------------
# Hugging Face folders
# --------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _hf_chat_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text(encoding="utf-8")
    template = _read_json(folder / "chat_template.json").get("chat_template") or config.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template


def _end_of_turn_ids(backend: Any, template: str | None) -> list[int]:
    if not template:
        return []
    ids = []
    for tok in END_OF_TURN_TOKENS:
        i = backend.token_to_id(tok)
        if i is not None and tok in template:
            ids.append(i)
    return ids


def _vocab_type(spec: Mapping[str, Any]) -> tuple[str, bool]:
    """(xgrammar vocab type, add_prefix_space) from a tokenizer's JSON form."""
    model = spec.get("model") or {}

    def kinds(node: Any) -> list[dict[str, Any]]:
        if not isinstance(node, dict):
            return []
        inner = node.get("pretokenizers") or node.get("decoders") or node.get("normalizers")
        return [node] + [k for child in (inner or []) for k in kinds(child)]

    parts = kinds(spec.get("pre_tokenizer")) + kinds(spec.get("decoder")) + kinds(spec.get("normalizer"))
    types = {p.get("type") for p in parts}
    prefix_space = any(
        (p.get("type") == "Metaspace" and p.get("prepend_scheme", "always") != "never" and p.get("add_prefix_space", True))
        or (p.get("type") == "Prepend" and p.get("prepend") == "▁")
        for p in parts
    )
    if model.get("byte_fallback"):
        return "byte_fallback", prefix_space
    if "ByteLevel" in types:
        return "byte_level", False
    return "raw", prefix_space


# --------------------------------------------------------------------------
# Chat templates
# --------------------------------------------------------------------------


def normalize_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """Drop None values; join a content list of text parts into one string."""
    out = {k: v for k, v in dict(message).items() if v is not None}
    content = out.get("content")
    if isinstance(content, (list, tuple)) and all(
        isinstance(p, Mapping) and p.get("type") == "text" for p in content
    ):
        out["content"] = "".join(str(p.get("text", "")) for p in content)
    return out


def compile_chat_template(template: str) -> Any:
    """A jinja2 template in an immutable sandbox, with transformers' extras:
    ``raise_exception``, ``strftime_now``, a ``tojson`` that keeps non-ASCII
    and takes indent / separators / sort_keys, loop controls, and the
    ``{% generation %}`` block tag (rendered as its body)."""
    import jinja2
    import jinja2.nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        # `{% generation %}...{% endgeneration %}` marks assistant text for training masks
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ConfigError(f"the chat template does not compile: {exc}") from exc
