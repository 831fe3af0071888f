"""--regenerate: the target writes the training continuations itself (greedy), as the published
recipe trains on target-regenerated responses. A drafter learns to predict what the target will
say, which is what acceptance rewards, rather than what some other writer said.

Generation is dense and batched (train/lm.greedy_generate): prompts of equal length share a
batch and a plain K/V tensor. The serving engine's paging, scheduling and per-token detokenizing
buy nothing here and cost most of the time."""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .data import MIN_TOKENS, Sample
from .lm import greedy_generate

log = logging.getLogger("lucebox")


def regenerate(loaded, prompts: list[Sample], seq_len: int, batch_size: int = 128,
               desc: str = "Regenerating", max_new: int | None = None) -> list[Sample]:
    """Each prompt plus the target's greedy continuation up to seq_len tokens (or its end-of-turn),
    and at most max_new tokens when given. Only the generated tokens are trained on."""
    if not prompts:
        return []
    model = loaded.model
    stop_ids = frozenset(loaded.tokenizer.eos_token_ids) | frozenset(loaded.config.eos_token_ids)
    # A batch shares one prompt length: sorted by length, each batch's prompts keep their last
    # `shortest` tokens. Text prompts are mostly full windows; the few short tails would otherwise
    # each cost a whole generation loop of their own.
    order = sorted((i for i, p in enumerate(prompts) if p.ids.numel() < seq_len), key=lambda i: -prompts[i].ids.numel())
    kept: dict[int, torch.Tensor] = {}
    generated: dict[int, list[int]] = {}
    def room(n: int) -> int:
        return min(seq_len - n, max_new) if max_new is not None else seq_len - n

    total = sum(room(prompts[i].ids.numel()) for i in order)  # an upper bound: rows may stop early
    with tqdm(total=total, desc=desc, unit="tok", disable=False, mininterval=10) as bar:
        for first in range(0, len(order), batch_size):
            chunk = order[first:first + batch_size]
            n = min(prompts[i].ids.numel() for i in chunk)
            ids = torch.stack([prompts[i].ids[-n:] for i in chunk])
            for i, row, gen in zip(chunk, ids, greedy_generate(model, ids.to(model.device), room(n), stop_ids)):
                kept[i], generated[i] = row, gen
            bar.update(sum(room(prompts[i].ids.numel()) for i in chunk))
    if model.device.type == "cuda":
        torch.cuda.empty_cache()
    samples = []
    for i in sorted(generated):
        prompt, gen = kept[i], torch.tensor(generated[i], dtype=torch.int64)
        ids = torch.cat([prompt, gen])
        if gen.numel() == 0 or ids.numel() < MIN_TOKENS:
            continue
        mask = torch.cat([torch.zeros(prompt.numel(), dtype=torch.bool), torch.ones(gen.numel(), dtype=torch.bool)])
        samples.append(Sample(ids, mask))
    return samples


def fingerprint(target: str, files: list[Path], settings: dict) -> str:
    """What the regenerated data depends on: the target, the data files, and the sampling settings."""
    h = hashlib.sha256()
    h.update(str(Path(target).expanduser().resolve()).encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    h.update(json.dumps(settings, sort_keys=True).encode())
    return h.hexdigest()


def load_cached(path: Path, key: str) -> tuple[list[Sample], list[Sample]] | None:
    if not path.is_file():
        return None
    try:
        raw = torch.load(path, weights_only=True)
    except Exception as e:  # a torn or foreign file: regenerate rather than fail
        log.warning("%s: unreadable (%s); regenerating", path, e)
        return None
    if raw.get("fingerprint") != key:
        log.info("%s: made from other data or settings; regenerating", path)
        return None

    def unpack(rows):
        return [Sample(ids, mask) for ids, mask in rows]

    return unpack(raw["train"]), unpack(raw["eval"])


def save_cached(path: Path, key: str, train: list[Sample], held: list[Sample]) -> None:
    tmp = path.with_name(path.name + ".partial")
    torch.save({"fingerprint": key, "train": [(s.ids, s.mask) for s in train],
                "eval": [(s.ids, s.mask) for s in held]}, tmp)
    os.replace(tmp, path)
