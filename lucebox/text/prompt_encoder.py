"""Incremental prompt encoding: a coding agent resends its whole conversation every turn, and
encoding a 75K-token prompt from scratch costs ~100 ms of host time before the GPU sees a token.

The backend tokenizer splits a text at its added tokens first and tokenizes the pieces between
them independently, so where a special token begins at character o of a text, the ids of text[:o]
are the ids every text sharing that prefix starts with. A new prompt therefore reuses a recent
prompt's ids up to the last special token inside their common prefix (a chat template opens every
message with one) and encodes only the rest. The split property is checked on the tokenizer once
(a probe); a tokenizer failing it is always encoded whole.
"""
from __future__ import annotations

import bisect
import itertools
import threading
from collections import OrderedDict
from dataclasses import dataclass

from ..util import common_prefix

# Prompts shorter than this are encoded whole and not kept: the search would cost what it saves.
MIN_CHARS = 2048
ENTRIES = 16  # recent prompts kept (one per conversation an agent or a user keeps going)
MAX_CHARS = 32 << 20  # characters kept across them


@dataclass
class _Encoded:
    text: str
    ids: list[int]
    starts: list[int]  # character offset of each special token's start, ascending
    before: list[int]  # ids before that special token


class PromptEncoder:
    """encode(text) == tokenizer.encode(text, add_special_tokens=False), from recent prompts' ids where
    it can. Thread-safe (the server renders prompts on worker threads)."""

    def __init__(self, backend, entries: int = ENTRIES, max_chars: int = MAX_CHARS):
        self.backend = backend
        self.entries, self.max_chars = entries, max_chars
        self.recent: OrderedDict[int, _Encoded] = OrderedDict()  # least recently used first
        self._keys = itertools.count()
        self.lock = threading.Lock()
        self.reused = self.encoded = 0  # ids taken from recent prompts / ids the backend produced
        self.splits = self._split_ids()

    def _split_ids(self) -> dict[int, str]:
        """Special tokens the backend splits texts at without reading around them (id -> text), if the
        probe agrees."""
        added = self.backend.get_added_tokens_decoder()
        splits = {i: t.content for i, t in added.items() if t.special and not (t.lstrip or t.rstrip or t.single_word)}
        if not splits:
            return splits
        token = splits[min(splits)]
        probe = f"a b{token}\n x y{token}z  \n{token}"
        cut = probe.index(token, probe.index(token) + 1)
        whole = self._encode(probe).ids
        if whole != self._encode(probe[:cut]).ids + self._encode(probe[cut:]).ids:
            return {}
        return splits

    def _encode(self, text: str):
        # encode_batch releases the GIL (encode holds it), as Tokenizer.encode
        return self.backend.encode_batch([text], add_special_tokens=False)[0]

    def encode(self, text: str) -> list[int]:
        if len(text) < MIN_CHARS or not self.splits:
            ids = self._encode(text).ids
            self.encoded += len(ids)
            return ids
        with self.lock:
            base_key, base, shared = None, None, 0
            for key, entry in self.recent.items():
                n = common_prefix(entry.text, text)
                if n > shared:
                    base_key, base, shared = key, entry, n
        cut, keep, starts, before = 0, 0, [], []
        if base is not None:
            k = bisect.bisect_right(base.starts, shared) - 1  # the last special token starting inside the prefix
            if k >= 0:
                cut, keep = base.starts[k], base.before[k]
                starts, before = base.starts[:k], base.before[:k]
        tail = self._encode(text[cut:])  # its offsets are characters of text[cut:]
        ids = base.ids[:keep] + tail.ids if keep else tail.ids
        piece = text[cut:]
        for j, (token, (start, end)) in enumerate(zip(tail.ids, tail.offsets)):
            # the special token written in the text (an unknown character may map to the same id)
            if token in self.splits and piece[start:end] == self.splits[token]:
                starts.append(cut + start)
                before.append(keep + j)
        entry = _Encoded(text, ids, starts, before)
        with self.lock:
            self.reused += keep
            self.encoded += len(tail.ids)
            if base is not None and base.starts and shared >= base.starts[-1]:
                self.recent.pop(base_key, None)  # past its last message: the conversation's newest prompt replaces it
            self.recent[next(self._keys)] = entry
            while len(self.recent) > self.entries or sum(len(e.text) for e in self.recent.values()) > self.max_chars:
                self.recent.popitem(last=False)
        return list(ids)
