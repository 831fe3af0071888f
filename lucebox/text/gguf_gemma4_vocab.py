"""Gemma 4's vocabulary in GGUF (tokenizer.ggml.model "gemma4", as llama.cpp's converter writes it and
src/llama-vocab.cpp reads it): SentencePiece-style BPE over raw UTF-8 (spaces written as U+2581, no
dummy prefix), merges in tokenizer.ggml.merges, text split only into runs of newlines and of other
characters, characters outside the vocabulary as <0xXX> byte tokens. Generation ends on <eos>, <turn|>
and <|tool_response> (a tool call waits for its result) whatever the *_token_id keys say, as llama.cpp
decides by their text.
"""
from __future__ import annotations

import re

import tokenizers
from gguf import TokenType
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers

from ..errors import CheckpointError

MODEL = "gemma4"
END_TOKENS = ("<eos>", "<turn|>", "<|tool_response>")
# llama.cpp's converter marks these USER_DEFINED so that they are always rendered (the chat parser reads them)
VISIBLE_TOKENS = frozenset({"<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
                            "<tool_response|>", '<|"|>'})
SPLIT = "[^\n]+|[\n]+"  # llama.cpp's LLAMA_VOCAB_PRE_TYPE_GEMMA4 split
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def gemma4_backend(tokens: list[str], merges: list[str], where: str) -> tokenizers.Tokenizer:
    """The `tokenizers` equivalent of llama.cpp's gemma4 tokenizer."""
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    pairs = []
    for m in merges:
        cut = m.find(" ", 1)  # llama.cpp's rule: "left right", left never empty
        if cut < 0:
            raise CheckpointError(f"{where}: malformed entry {m!r} in tokenizer.ggml.merges")
        pairs.append((m[:cut], m[cut + 1:]))
    try:
        tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, byte_fallback=True))
    except Exception as e:
        raise CheckpointError(f"{where}: tokenizer.ggml.merges does not fit tokenizer.ggml.tokens: {e}") from e
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(SPLIT), behavior="isolated")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok


def end_token_ids(tokens: list[str]) -> list[int]:
    """The ids of Gemma 4's end-of-generation tokens present in the vocabulary."""
    return [i for i, t in enumerate(tokens) if t in END_TOKENS]


def is_gemma4_style(spec: dict) -> bool:
    """A tokenizer.json that is Gemma's SentencePiece-style BPE (byte fallback, no byte-level alphabet)."""
    model = spec.get("model") or {}
    return model.get("type") == "BPE" and bool(model.get("byte_fallback")) and "ByteLevel" not in str(spec)


def gemma4_vocabulary(tok, spec: dict, size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of tokenizer.ggml.* for a Gemma-style tokenizer.json, padded to `size`
    (the embedding's rows) with unused [PADi] tokens as llama.cpp's converter does."""
    vocab = tok.backend.get_vocab(with_added_tokens=True)
    if max(vocab.values()) + 1 > size:
        raise CheckpointError(f"the tokenizer has {max(vocab.values()) + 1} tokens but the model's embedding only "
                              f"{size} rows")
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [TokenType.UNUSED] * size
    for token, i in vocab.items():
        tokens[i] = token
        types[i] = TokenType.BYTE if _BYTE_TOKEN.fullmatch(token) else TokenType.NORMAL
    for i, added in tok.backend.get_added_tokens_decoder().items():
        types[i] = TokenType.CONTROL if added.special else TokenType.USER_DEFINED
    for i, token in enumerate(tokens):
        if token in VISIBLE_TOKENS:
            types[i] = TokenType.USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges", [])]
    return tokens, types, merges
