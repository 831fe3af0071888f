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
from collections import defaultdict
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .data import MIN_TOKENS, Sample
from .lm import greedy_generate

log = logging.getLogger("lucebox")


def regenerate(loaded, prompts: list[Sample], seq_len: int, batch_size: int = 128,
               desc: str = "Regenerating") -> list[Sample]:
    """Each prompt plus the target's greedy continuation up to seq_len tokens (or its end-of-turn).
    Only the generated tokens are trained on."""
    if not prompts:
        return []
    model = loaded.model
    stop_ids = frozenset(loaded.tokenizer.eos_token_ids) | frozenset(loaded.config.eos_token_ids)
    by_length: dict[int, list[int]] = defaultdict(list)
    for i, p in enumerate(prompts):
        if p.ids.numel() < seq_len:
            by_length[p.ids.numel()].append(i)
    generated: dict[int, list[int]] = {}
    # Counted in tokens (the most a batch can write), and shown without a terminal too.
    total = sum((seq_len - n) * len(rows) for n, rows in by_length.items())
    with tqdm(total=total, desc=desc, unit="tok", disable=False, mininterval=10) as bar:
        for n, rows in sorted(by_length.items()):
            for first in range(0, len(rows), batch_size):
                chunk = rows[first:first + batch_size]
                ids = torch.stack([prompts[i].ids for i in chunk]).to(model.device)
                for i, gen in zip(chunk, greedy_generate(model, ids, seq_len - n, stop_ids)):
                    generated[i] = gen
                bar.update((seq_len - n) * len(chunk))
    if model.device.type == "cuda":
        torch.cuda.empty_cache()
    samples = []
    for i, p in enumerate(prompts):
        gen = torch.tensor(generated.get(i, []), dtype=torch.int64)
        ids = torch.cat([p.ids, gen])
        if gen.numel() == 0 or ids.numel() < MIN_TOKENS:
            continue
        mask = torch.cat([torch.zeros(p.ids.numel(), dtype=torch.bool), torch.ones(gen.numel(), dtype=torch.bool)])
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
