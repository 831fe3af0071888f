"""Training data for the drafter: text files and JSONL records, tokenized with the target's tokenizer.

Accepted inputs (files or directories, read recursively):
  any text file     one document; documents of a split are packed back to back (separated by the
                    end-of-text token when the vocabulary has one) and cut into --seq-len windows,
                    every token trained on;
  *.jsonl           one record per line: {"text": ...} (a text document) or {"messages": [...]}
                    (a conversation, rendered with the target's chat template; only the assistant
                    tokens are trained on, as the published recipe does).

The held-out split is by file (by record when there is a single file), so evaluation never sees
text from a file the drafter trained on; with --eval-data the held-out samples come from those
files instead (processed the same way) and all of --data is trained on. With --regenerate the
samples become prompts whose continuations the target writes itself (regenerate.py); the loss then
covers those tokens only.
"""
from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..errors import RequestError

log = logging.getLogger("lucebox")

MIN_TOKENS = 4  # shorter samples have nothing to anchor a block on
SEPARATORS = ("<|endoftext|>", "</s>", "<|end_of_text|>")


@dataclass
class Sample:
    ids: torch.Tensor  # [n] int64
    mask: torch.Tensor | None = None  # [n] bool: positions trained on (None: all)


@dataclass
class Document:
    source: str  # file, or file:line for a JSONL record
    text: str | None = None
    messages: list | None = None


def collect_files(paths: list[str], flag: str = "--data") -> list[Path]:
    files: list[Path] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file()
                           and not any(part.startswith(".") or part == "__pycache__"
                                       for part in p.relative_to(path).parts))
            if not found:
                raise RequestError(f"{flag} {raw}: the directory holds no files")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise RequestError(f"{flag} {raw}: no such file or directory")
    if not files:
        raise RequestError(f"{flag}: give at least one text or .jsonl file (or a directory of them)")
    return list(dict.fromkeys(files))


def read_documents(file: Path) -> list[Document]:
    """The documents of one file; binary or non-UTF-8 files give none (and a log line)."""
    data = file.read_bytes()
    if b"\0" in data[:8192]:
        log.info("skipping %s: binary file", file)
        return []
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        log.info("skipping %s: not UTF-8 text", file)
        return []
    if file.suffix != ".jsonl":
        return [Document(str(file), text=text)] if text.strip() else []
    docs = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{file}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise RequestError(f"{where}: not valid JSON ({e.msg})") from None
        if isinstance(record, dict) and isinstance(record.get("text"), str):
            docs.append(Document(where, text=record["text"]))
        elif isinstance(record, dict) and isinstance(record.get("messages"), list):
            docs.append(Document(where, messages=record["messages"]))
        else:
            raise RequestError(f"{where}: a JSONL record needs a string 'text' or a list 'messages'")
    return docs


def read_files(files: list[Path], flag: str) -> list[list[Document]]:
    """The documents of each file that holds any."""
    per_file = [read_documents(f) for f in tqdm(files, desc=f"Reading {flag[2:]}", unit="file", disable=None)]
    per_file = [docs for docs in per_file if docs]
    if not per_file:
        shown = " ".join(map(str, files[:3])) + (" ..." if len(files) > 3 else "")
        raise RequestError(f"{flag} {shown}: none of the files holds UTF-8 text or JSONL records")
    return per_file


def split_documents(per_file: list[list[Document]], eval_fraction: float, seed: int
                    ) -> tuple[list[Document], list[Document]]:
    """Held-out documents: whole files when there are several, else records (or a single
    document's tail, handled after tokenization: then the eval list holds it too)."""
    if eval_fraction <= 0:
        return [d for docs in per_file for d in docs], []
    rng = random.Random(seed)
    if len(per_file) >= 2:
        order = list(range(len(per_file)))
        rng.shuffle(order)
        n_eval = min(len(per_file) - 1, max(1, round(eval_fraction * len(per_file))))
        held = set(order[:n_eval])
        train = [d for i, docs in enumerate(per_file) if i not in held for d in docs]
        held_out = [d for i, docs in enumerate(per_file) if i in held for d in docs]
        return train, held_out
    docs = list(per_file[0])
    if len(docs) == 1:
        return docs, []
    rng.shuffle(docs)
    n_eval = min(len(docs) - 1, max(1, round(eval_fraction * len(docs))))
    return docs[n_eval:], docs[:n_eval]


def encode_texts(tokenizer, texts: list[str], desc: str) -> list[torch.Tensor]:
    """Batched tokenization (the Rust side runs the batch on all cores)."""
    backend = tokenizer.backend
    encode = getattr(backend, "encode_batch_fast", None) or backend.encode_batch
    out = []
    chunk = 256
    with tqdm(total=len(texts), desc=desc, unit="doc", disable=None) as bar:
        for start in range(0, len(texts), chunk):
            for enc in encode(texts[start:start + chunk], add_special_tokens=False):
                out.append(torch.tensor(enc.ids, dtype=torch.int64))
            bar.update(min(chunk, len(texts) - start))
    return out


def render_conversation(tokenizer, messages: list, where: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(ids, assistant-token mask, prompt length before the last assistant turn).

    Each assistant turn is located by rendering the conversation up to it with and without the
    generation prompt: the text in between is what the model writes. The pieces are tokenized
    separately so the mask falls exactly on the assistant's tokens."""
    roles = [m.get("role") if isinstance(m, dict) else None for m in messages]
    turns = [i for i, r in enumerate(roles) if r == "assistant"]
    if not turns:
        raise RequestError(f"{where}: the conversation has no assistant message to train on")
    pieces: list[tuple[str, bool]] = []
    done = ""
    for i in turns:
        before = tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True)
        after = tokenizer.apply_chat_template(messages[:i + 1], add_generation_prompt=False)
        if not (before.startswith(done) and after.startswith(before)):
            raise RequestError(f"{where}: the chat template does not render this conversation as a growing "
                               "prefix, so the assistant tokens cannot be located")
        pieces += [(before[len(done):], False), (after[len(before):], True)]
        done = after
    full = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    if full.startswith(done) and len(full) > len(done):
        pieces.append((full[len(done):], False))
    ids, mask, prompt_len = [], [], 0
    for k, (text, trained) in enumerate(pieces):
        if k == len(turns) * 2 - 1:  # the last assistant turn starts here
            prompt_len = len(ids)
        part = tokenizer.encode(text, add_special_tokens=False) if text else []
        ids += part
        mask += [trained] * len(part)
    return torch.tensor(ids, dtype=torch.int64), torch.tensor(mask, dtype=torch.bool), prompt_len


def separator_id(tokenizer) -> int | None:
    for name in SEPARATORS:
        if (i := tokenizer.token_to_id(name)) is not None:
            return i
    return tokenizer.eos_token_id


def pack(streams: list[torch.Tensor], seq_len: int, sep: int | None) -> list[Sample]:
    """Documents back to back, cut into seq_len windows (the last one kept if long enough)."""
    if not streams:
        return []
    parts = []
    for s in streams:
        parts.append(s)
        if sep is not None:
            parts.append(torch.tensor([sep], dtype=torch.int64))
    flat = torch.cat(parts)
    return [Sample(w.clone()) for w in flat.split(seq_len) if w.numel() >= MIN_TOKENS]


def prompts_of(streams: list[torch.Tensor], prompt_len: int) -> list[Sample]:
    """--regenerate on text: consecutive prompt_len pieces of each document become prompts."""
    out = []
    for s in streams:
        for w in s.split(prompt_len):
            if w.numel() >= MIN_TOKENS:
                out.append(Sample(w.clone()))
    return out


def build_samples(tokenizer, docs: list[Document], seq_len: int, regenerate: bool, prompt_len: int,
                  desc: str) -> list[Sample]:
    texts = [d.text for d in docs if d.text is not None]
    streams = encode_texts(tokenizer, texts, desc) if texts else []
    samples = prompts_of(streams, prompt_len) if regenerate else pack(streams, seq_len, separator_id(tokenizer))
    for d in docs:
        if d.messages is None:
            continue
        ids, mask, before_last = render_conversation(tokenizer, d.messages, d.source)
        if regenerate:  # the last assistant turn is rewritten by the target
            if 0 < before_last < seq_len:
                samples.append(Sample(ids[:before_last]))
        elif int(mask[1:seq_len].sum()) > 0:
            samples.append(Sample(ids[:seq_len], mask[:seq_len]))
    return samples


def subset(samples: list[Sample], limit: int | None, seed: int) -> list[Sample]:
    if limit is None or len(samples) <= limit:
        return samples
    picked = sorted(random.Random(seed).sample(range(len(samples)), limit))
    return [samples[i] for i in picked]


def load_samples(files: list[Path], tokenizer, seq_len: int, eval_fraction: float, eval_samples: int,
                 max_samples: int | None, regenerate: bool, prompt_len: int, seed: int,
                 eval_files: list[Path] | None = None) -> tuple[list[Sample], list[Sample]]:
    """(train, held-out) samples, capped at max_samples / eval_samples (seeded choice). With
    eval_files the held-out samples are theirs and eval_fraction is ignored."""
    if eval_files is not None:
        eval_fraction = 0.0
    train_docs, eval_docs = split_documents(read_files(files, "--data"), eval_fraction, seed)
    if eval_files is not None:
        eval_docs = [d for docs in read_files(eval_files, "--eval-data") for d in docs]
    train = build_samples(tokenizer, train_docs, seq_len, regenerate, prompt_len, "Tokenizing train")
    held = build_samples(tokenizer, eval_docs, seq_len, regenerate, prompt_len, "Tokenizing held-out")
    if eval_files is not None and not held:
        raise RequestError(f"--eval-data gives no held-out sample of at least {MIN_TOKENS} tokens")
    if not held and len(train) >= 2 and eval_fraction > 0:  # one document: hold out its tail windows
        n_eval = max(1, round(eval_fraction * len(train)))
        train, held = train[:-n_eval], train[-n_eval:]
        log.warning("--data is a single document: holding out its last %d window(s) for evaluation", n_eval)
    if not train:
        raise RequestError(f"--data gives no training sample of at least {MIN_TOKENS} tokens")
    return subset(train, max_samples, seed), subset(held, eval_samples, seed + 1)


def collate(samples: list[Sample], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [S, T] (0-padded), lengths [S], trained-on mask [S, T] (False on padding)."""
    lengths = torch.tensor([s.ids.numel() for s in samples], dtype=torch.int64)
    width = int(lengths.max())
    ids = torch.zeros(len(samples), width, dtype=torch.int64)
    mask = torch.zeros(len(samples), width, dtype=torch.bool)
    for i, s in enumerate(samples):
        n = s.ids.numel()
        ids[i, :n] = s.ids
        mask[i, :n] = True if s.mask is None else s.mask
    return ids.to(device), lengths.to(device), mask.to(device)
