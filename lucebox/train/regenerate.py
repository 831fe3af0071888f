"""--regenerate: the target writes the training continuations itself (greedy, batched in lucebox's
own engine), as the published recipe trains on target-regenerated responses. A drafter learns to
predict what the target will say, which is what acceptance rewards, rather than what some other
writer said."""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..config import EngineArgs
from ..engine.engine import LLMEngine
from ..engine.runner import kv_bytes_per_token
from ..sampling import SamplingParams
from .data import MIN_TOKENS, Sample

log = logging.getLogger("lucebox")


def regenerate(loaded, prompts: list[Sample], seq_len: int, max_num_seqs: int = 128,
               desc: str = "Regenerating") -> list[Sample]:
    """Each prompt plus the target's greedy continuation up to seq_len tokens (or its end-of-turn).
    Only the generated tokens are trained on."""
    if not prompts:
        return []
    model = loaded.model
    max_num_seqs = max(1, min(max_num_seqs, len(prompts)))
    # An explicit pool: the engine would otherwise claim most of the GPU for its KV cache.
    pool = int(kv_bytes_per_token(model) * (seq_len + 64) * max_num_seqs * 1.25)
    args = EngineArgs(model=loaded.source, max_model_len=seq_len, max_num_seqs=max_num_seqs,
                      kv_cache_memory=pool, enable_prefix_caching=False, max_queue=len(prompts) + 1)
    engine = LLMEngine(loaded, args)
    # Pure argmax: the model's generation_config must not add penalties or truncation to "greedy".
    params = [SamplingParams(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0,
                             max_tokens=seq_len - p.ids.numel(), skip_special_tokens=False)
              for p in prompts]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), {"prompt_token_ids": p.ids.tolist()}, sp)
    done: dict[int, list[int]] = {}
    produced: dict[int, int] = {}
    # Counted in tokens, and shown without a terminal too: every sample finishes at about the same
    # step, so a per-sample bar would sit at 0% for the whole (possibly long) run.
    with tqdm(total=sum(sp.max_tokens for sp in params), desc=desc, unit="tok", disable=False,
              mininterval=10) as bar:
        while engine.has_unfinished():
            for out in engine.step():
                i, n = int(out.request_id), len(out.outputs[0].token_ids)
                bar.update(n - produced.get(i, 0))
                produced[i] = n
                if out.finished:
                    done[i] = out.outputs[0].token_ids
    del engine
    if model.device.type == "cuda":
        torch.cuda.empty_cache()
    samples = []
    for i, p in enumerate(prompts):
        gen = torch.tensor(done[i], dtype=torch.int64)
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
