"""GGUF vocabularies -> `tokenizers.Tokenizer`: byte-level BPE (gpt2 model with llama-bpe / qwen2
pre-tokenizers), SentencePiece-style (llama model) and Gemma 4 (gemma4 model: text/gguf_gemma4_vocab.py)
vocabularies, rebuilt from `tokenizer.*` metadata."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import tokenizers
from gguf import GGUFValueType, TokenType
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from ..errors import CheckpointError, UnsupportedError
from . import gguf_gemma4_vocab as gemma4_vocab
from .tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _BYTE = (
    TokenType.NORMAL, TokenType.UNKNOWN, TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.BYTE
)

# Pre-tokenizer regexes selected by `tokenizer.ggml.pre`, as written in the models' own tokenizer.json.
LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN35_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Laguna's tokenizer.json splits into newline and non-newline runs first, then with Qwen2's regex
# (llama.cpp's LLAMA_VOCAB_PRE_TYPE_LAGUNA, tokenizer.ggml.pre "laguna").
NEWLINE_RUNS_REGEX = r"[^\n]+|[\n]+"
_LLAMA3_PRE = {"llama3", "llama-v3", "llama-bpe"}
_QWEN_PRE = {"qwen2": QWEN2_REGEX, "deepseek-r1-qwen": QWEN2_REGEX, "qwen35": QWEN35_REGEX}
_GPT2_PRE = {"default", "gpt-2", "gpt2"}


def tokenizer_from_gguf(reader: Any, path: str | Path | None = None) -> Tokenizer:
    """Rebuild the tokenizer from a `gguf.GGUFReader`'s `tokenizer.*` metadata."""
    where = str(path if path is not None else getattr(reader, "path", "<gguf>"))
    meta = _GGUFMeta(reader, where)
    kind = meta.get("tokenizer.ggml.model", str)
    if kind is None:
        raise CheckpointError(f"{where}: no tokenizer.ggml.model key, so the file carries no tokenizer")
    tokens = meta.get("tokenizer.ggml.tokens", list, required=True)
    n = len(tokens)
    types = meta.get("tokenizer.ggml.token_type", list) or [_NORMAL] * n
    if len(types) != n:
        raise CheckpointError(f"{where}: tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")
    pre = meta.get("tokenizer.ggml.pre", str) or "default"
    if kind == "gpt2":
        merges = meta.get("tokenizer.ggml.merges", list, required=True)
        backend = _byte_level_bpe(tokens, merges, pre, where)
        default_ids, default_add_bos = {}, pre in _LLAMA3_PRE
    elif kind == "llama":
        scores = meta.get("tokenizer.ggml.scores", list, required=True)
        if len(scores) != n:
            raise CheckpointError(f"{where}: tokenizer.ggml.scores has {len(scores)} entries for {n} tokens")
        add_prefix = meta.get("tokenizer.ggml.add_space_prefix", bool)
        unk_id = meta.get("tokenizer.ggml.unknown_token_id", int)
        unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < n else None
        backend = _sentencepiece_bpe(tokens, types, scores, add_prefix is not False, unk)
        # llama.cpp's defaults for SentencePiece vocabularies written without these keys.
        default_ids, default_add_bos = {"bos": 1, "eos": 2, "unknown": 0}, True
    elif kind == gemma4_vocab.MODEL:
        merges = meta.get("tokenizer.ggml.merges", list, required=True)
        backend = gemma4_vocab.gemma4_backend(tokens, merges, where)
        default_ids, default_add_bos = {}, True
    else:
        raise UnsupportedError(
            f"{where}: tokenizer model {kind!r} (tokenizer.ggml.model) is not supported; "
            "lucebox reads 'gpt2' (byte-level BPE), 'llama' (SentencePiece) and 'gemma4' vocabularies"
        )

    # Control tokens are matched whole in text and dropped by skip_special_tokens; user-defined ones
    # are matched whole but are ordinary text otherwise (llama.cpp treats them the same way).
    backend.add_tokens(
        [
            AddedToken(t, special=types[i] in (_CONTROL, _UNKNOWN), normalized=False)
            for i, t in enumerate(tokens)
            if t and types[i] in (_CONTROL, _UNKNOWN, _USER_DEFINED)
        ]
    )

    def token_for(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id", int)
        i = default_ids.get(key) if i is None else i
        return tokens[i] if i is not None and 0 <= i < n else None

    special = {
        "bos_token": token_for("bos"),
        "eos_token": token_for("eos"),
        "unk_token": token_for("unknown"),
        "sep_token": token_for("seperator"),  # sic: the GGUF key is spelled this way
        "pad_token": token_for("padding"),
        "mask_token": token_for("mask"),
    }
    # end-of-turn / end-of-message tokens stop generation too
    eos_ids = []
    for key in ("eot", "eom"):
        i = meta.get(f"tokenizer.ggml.{key}_token_id", int)
        if i is not None and 0 <= i < n:
            eos_ids.append(i)
    add_bos = meta.get("tokenizer.ggml.add_bos_token", bool)
    if kind == gemma4_vocab.MODEL:  # as llama.cpp: end tokens known by their text, <bos> always added
        eos_ids += gemma4_vocab.end_token_ids(tokens)
        add_bos = True
    add_eos = meta.get("tokenizer.ggml.add_eos_token", bool)

    templates = {}
    if (default := meta.get("tokenizer.chat_template", str)) is not None:
        templates["default"] = default
    for name in meta.get("tokenizer.chat_templates", list) or []:
        if (text := meta.get(f"tokenizer.chat_template.{name}", str)) is not None:
            templates[name] = text
    return Tokenizer(
        backend,
        special_tokens=special,
        eos_token_ids=eos_ids,
        chat_template=templates,
        add_bos_token=default_add_bos if add_bos is None else add_bos,
        add_eos_token=bool(add_eos),
        name=where,
    )


class _GGUFMeta:
    """Typed access to GGUF metadata; a wrong type or a missing required key is a CheckpointError."""

    def __init__(self, reader: Any, where: str):
        self.fields, self.where = reader.fields, where

    def get(self, key: str, kind: type, required: bool = False) -> Any:
        field = self.fields.get(key)
        if field is None:
            if required:
                raise CheckpointError(f"{self.where}: metadata key {key} is missing")
            return None
        try:
            value = _field_value(field)
        except UnicodeDecodeError as e:
            raise CheckpointError(f"{self.where}: metadata key {key} is not valid UTF-8: {e}") from e
        if kind is int and isinstance(value, bool) or not isinstance(value, kind):
            raise CheckpointError(f"{self.where}: metadata key {key} should be {kind.__name__}, got {value!r:.80}")
        return value


def _field_value(field: Any) -> Any:
    """A GGUFReader field as Python values (`parts` holds raw numpy views; `data` indexes the values in it)."""
    if field.types[0] == GGUFValueType.ARRAY:
        if field.types[-1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return [v for i in field.data for v in field.parts[i].tolist()]
    if field.types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    return field.parts[field.data[0]].tolist()[0]


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str, where: str) -> tokenizers.Tokenizer:
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    pairs = []
    for m in merges:
        cut = m.find(" ", 1)  # llama.cpp's rule: a merge is "left right", left never empty
        if cut < 0:
            raise CheckpointError(f"{where}: malformed entry {m!r} in tokenizer.ggml.merges")
        pairs.append((m[:cut], m[cut + 1 :]))
    try:
        # Llama 3 looks a whole pre-token up in the vocabulary before merging (its tokenizer.json says so).
        tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre in _LLAMA3_PRE))
    except Exception as e:
        raise CheckpointError(f"{where}: tokenizer.ggml.merges does not fit tokenizer.ggml.tokens: {e}") from e

    if pre in _LLAMA3_PRE:
        regexes = [LLAMA3_REGEX]
    elif pre == "laguna":
        regexes = [NEWLINE_RUNS_REGEX, QWEN2_REGEX]
    elif pre in _QWEN_PRE:
        regexes = [_QWEN_PRE[pre]]
        tok.normalizer = normalizers.NFC()  # Qwen's tokenizer.json normalises to NFC first
    else:
        if pre not in _GPT2_PRE:
            logger.warning(
                "%s: pre-tokenizer %r (tokenizer.ggml.pre) is unknown to lucebox; splitting text with the GPT-2 "
                "regex instead, so some texts may tokenize differently than with llama.cpp",
                where,
                pre,
            )
        regexes = []
    if not regexes:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                *(pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in regexes),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(
    tokens: list[str], types: list[int], scores: list[float], add_space_prefix: bool, unk: str | None
) -> tokenizers.Tokenizer:
    """llama.cpp's SentencePiece tokenizer as a BPE model.

    llama.cpp starts from characters and repeatedly joins the adjacent pair whose concatenation is the
    vocabulary piece with the highest score. A BPE model whose merges are every (left, right) split of each
    piece, ranked by that piece's score, makes the same choices.
    """
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    # Control, unknown and byte pieces are never built from text.
    mergeable = {t: i for t, i in vocab.items() if types[i] not in (_CONTROL, _UNKNOWN, _BYTE)}
    ranked = []
    for piece, i in mergeable.items():
        for k in range(1, len(piece)):
            if piece[:k] in mergeable and piece[k:] in mergeable:
                ranked.append((-scores[i], i, k))
    ranked.sort()
    merges = [(tokens[i][:k], tokens[i][k:]) for _, i, k in ranked]
    # Characters missing from the vocabulary fall back to <0xXX> byte pieces, one token per byte.
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, byte_fallback=True))
    escape = normalizers.Replace(" ", "\u2581")
    unescape = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        # sentencepiece's add_dummy_prefix; llama.cpp adds it to every text run, also after a special token
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), escape])
        tok.decoder = decoders.Sequence([*unescape, decoders.Strip(" ", 1, 0)])
    else:
        tok.normalizer = escape
        tok.decoder = decoders.Sequence(unescape)
    return tok


# ---- HF files ----------------------------------------------------------------------------------------
