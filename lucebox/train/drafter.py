"""`lucebox train-drafter`: train a DFlash drafter for a target with the published recipe.

Per step: a batch of sequences goes through the frozen target once (a dense forward, tapped
layers captured); anchors are re-drawn; every block of every sequence is drafted in one forward
(blocks.py); the loss is the slot-weighted cross-entropy through the target's own LM head. Only
fc, hidden_norm, the draft layers and norm learn. AdamW, cosine schedule with warm-up, gradient
clipping; bf16 autocast whenever the target runs in a 16-bit dtype.

The output directory holds the drafter in the z-lab layout (config.json + model.safetensors,
rewritten at every checkpoint, so it is usable while training runs), train_state.pt (everything
--resume needs) and training_log.jsonl (the evaluations).
"""
from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..errors import CheckpointError, RequestError
from ..model.loader import load_model, resolve_device
from ..spec.dflash import check_fits_target, load_drafter
from ..spec.dflash_model import DFlashConfig, save_drafter
from . import blocks
from .args import TrainDrafterArgs
from .data import Sample, collate, collect_files, load_samples
from .prepare import TargetFeatures, drafter_config, init_drafter, lm_head
from .regenerate import fingerprint, load_cached, regenerate, save_cached
from .selector import selector_drafts, selector_loss

log = logging.getLogger("lucebox")

STATE_FILE = "train_state.pt"
REGEN_FILE = "regenerated.pt"
LOG_FILE = "training_log.jsonl"
WARM_STEPS = 3  # --max-seconds: steps run before timing (the first ones compile kernels) ...
PROBE_STEPS = 20  # ... and the steps timed to fix the schedule


@dataclass
class EvalResult:
    tau: float  # committed tokens per verify step, replaying greedy speculation over the held-out text
    slot_accuracy: list[float]  # [k-1]: how often slot k's draft equals the target's greedy token
    loss: float
    steps: int  # verify steps replayed

    def summary(self) -> str:
        shown = " ".join(f"{a:.2f}" for a in self.slot_accuracy[:8]) + (" ..." if len(self.slot_accuracy) > 8 else "")
        return f"tau {self.tau:.3f}, loss {self.loss:.3f}, acc@slot {shown}"


@dataclass
class TrainResult:
    out: Path
    start_step: int
    step: int
    seconds: float
    final: EvalResult | None
    history: list[dict] = field(default_factory=list)


def train_drafter(args: TrainDrafterArgs) -> TrainResult:
    args.validate()
    out = Path(args.out).expanduser()
    state_file = out / STATE_FILE
    if args.resume and not state_file.is_file():
        raise RequestError(f"--resume: {state_file} not found; there is no training run to continue in {out}")
    if not args.resume and state_file.is_file():
        raise RequestError(f"{out} already holds a training run ({STATE_FILE}); pass --resume to continue it "
                           "or choose another --out")
    files = collect_files(args.data)
    eval_files = _eval_files(args, files)
    device = resolve_device(args.device)
    # bf16 on GPU even for float32 checkpoints: the target is frozen, and features in bf16 are
    # what a bf16 deployment feeds the drafter anyway.
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    loaded = load_model(args.target, dtype=dtype, device=str(device))
    target = loaded.model
    target.requires_grad_(False)
    tcfg = loaded.config
    if args.seq_len > tcfg.max_position_embeddings:
        raise RequestError(f"--seq-len {args.seq_len} exceeds the target's context of "
                           f"{tcfg.max_position_embeddings} positions")
    start = load_drafter(args.init_drafter, torch.float32, "cpu")[0] if args.init_drafter else None
    cfg = drafter_config(tcfg, loaded.tokenizer, args, start.config if start is not None else None)
    state = _load_state(state_file, cfg) if args.resume else None
    check_fits_target(cfg, loaded, "the drafter to train")
    out.mkdir(parents=True, exist_ok=True)
    train, held = _samples(args, files, eval_files, loaded, out)

    drafter = init_drafter(cfg, device, args.seed, target if args.init_from_target else None, start)
    # With --max-seconds alone the step count is set after WARM_STEPS + PROBE_STEPS steps.
    steps = args.steps or (1 << 40 if args.max_seconds else max(1, math.ceil(len(train) / args.batch_size)))
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=args.lr, weight_decay=args.weight_decay,
                                  betas=(0.9, 0.95), **({"fused": True} if device.type == "cuda" else {}))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, blocks.cosine_with_warmup(steps, args.warmup))
    history: list[dict] = []
    start = 0
    if state is not None:
        drafter.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["scheduler"])
        start, history = int(state["step"]), list(state.get("history", []))
        torch.set_rng_state(state["rng"]["torch"])
        if device.type == "cuda" and state["rng"].get("cuda"):
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        log.warning("resuming %s at step %d of %d", out, start, steps)

    eval_batch = max(1, min(args.batch_size, (1 << 30) // (4 * args.seq_len * tcfg.vocab_size)))
    features = TargetFeatures(target, cfg.target_layer_ids)
    # bf16 autocast for any 16-bit target: bf16's range needs no loss scaling, even under an fp16 target.
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if target.dtype != torch.float32
                else nullcontext())
    raw_head = lm_head(target)
    embed = partial(drafter.block_input, target)  # the block rows the engine drafts from

    def head(hidden: torch.Tensor) -> torch.Tensor:  # the logits the engine drafts from (multiplier, soft-cap)
        return drafter.logits(raw_head(hidden))

    weights = blocks.slot_weights(cfg.block_size, args.gamma or blocks.default_gamma(cfg.block_size), device)
    eval_every = args.eval_every if args.eval_every is not None else max(1, steps // 10)
    per_epoch = max(1, math.ceil(len(train) / args.batch_size))

    def evaluate() -> EvalResult | None:
        return _evaluate(drafter, target, head, features, held, cfg, weights, args, eval_batch, autocast)

    def checkpoint(step: int) -> None:
        _save_state(state_file, drafter, optimizer, schedule, step, cfg, history)
        save_drafter(drafter, out, getattr(torch, args.save_dtype))

    started = time.perf_counter()
    warm = 0.0  # --max-seconds: the time of the first WARM_STEPS
    bar = tqdm(total=steps, initial=start, desc="Training drafter", unit="step", disable=_disabled(args))
    smoothed = None
    try:
        for step in range(start, steps):
            batch = _batch(train, step, per_epoch, args)
            ids, lengths, mask = collate(batch, device)
            feats, _ = features(ids, lengths)
            generator = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
            anchors, keep = blocks.sample_anchors(blocks.anchor_candidates(lengths, mask), args.anchors, generator)
            labels, valid = blocks.block_targets(ids, lengths, mask, anchors, keep, cfg.block_size)
            with autocast:
                hidden = blocks.draft_hidden(drafter, embed, feats, ids, anchors, cfg.mask_token_id)
                total, weight, correct = blocks.weighted_ce(head, hidden, labels, valid, weights, tcfg.vocab_size)
                selector = getattr(drafter, "candidate_selector", None)  # DFlash2
                if selector is not None:
                    total = total + selector_loss(selector, head, hidden, ids.gather(1, anchors), labels, valid,
                                                  weights, tcfg.vocab_size)
            optimizer.zero_grad(set_to_none=True)
            if total.requires_grad:  # a batch without any trainable slot leaves the weights alone
                loss = total / weight
                loss.backward()
                torch.nn.utils.clip_grad_norm_(drafter.parameters(), args.grad_clip)
                optimizer.step()
                if step % 10 == 0 or step == steps - 1:  # one host sync every few steps, not every step
                    value = float(loss.detach())
                    smoothed = value if smoothed is None else 0.8 * smoothed + 0.2 * value
                    bar.set_postfix(loss=f"{smoothed:.3f}", acc=f"{int(correct) / max(1, int(valid.sum())):.2f}",
                                    lr=f"{schedule.get_last_lr()[0]:.1e}")
            schedule.step()
            bar.update(1)
            done = step + 1
            if eval_every and done % eval_every == 0 and done < steps:
                result = evaluate()
                if result is not None:
                    history.append(_record(done, result, smoothed))
                    _append_log(out, history[-1])
                    bar.write(f"step {done}: {result.summary()}")
            if done % args.save_every == 0 and done < steps:
                checkpoint(done)
            if args.max_seconds is not None:
                if done == start + WARM_STEPS:  # compilation and autotuning stay out of the measured rate
                    warm = _elapsed(started, device)
                probe = done == start + WARM_STEPS + PROBE_STEPS
                # Synced only to time the probe: the budget check itself may run a step ahead of the GPU.
                elapsed = _elapsed(started, device) if probe else time.perf_counter() - started
                if probe:
                    steps = _steps_that_fit(steps, done, elapsed, (elapsed - warm) / PROBE_STEPS, args)
                    schedule.lr_lambdas = [blocks.cosine_with_warmup(steps, args.warmup)]
                    bar.total = steps
                elif elapsed >= args.max_seconds:
                    log.warning("--max-seconds %s reached at step %d of %d", args.max_seconds, done, steps)
                    steps = done
                if done >= steps:
                    break
    except KeyboardInterrupt:
        # A stopped run (Ctrl-C, `timeout -s INT`) still leaves its newest weights as a usable
        # drafter; --resume continues from the last full checkpoint.
        bar.close()
        save_drafter(drafter, out, getattr(torch, args.save_dtype))
        log.warning("interrupted: wrote the current drafter to %s; --resume continues from the last checkpoint", out)
        raise
    bar.close()
    final = evaluate()
    if final is not None:
        history.append(_record(steps, final, smoothed))
        _append_log(out, history[-1])
    checkpoint(steps)
    return TrainResult(out, start, steps, time.perf_counter() - started, final, history)


def _elapsed(started: float, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def _steps_that_fit(steps: int, done: int, elapsed: float, rate: float, args: TrainDrafterArgs) -> int:
    """--max-seconds: the cosine schedule is laid out over the steps that the rate measured over
    PROBE_STEPS (after WARM_STEPS) allows (5% kept for evaluations and checkpoints), never more than
    --steps."""
    fit = done + int(0.95 * (args.max_seconds - elapsed) / rate)
    chosen = max(done, min(steps, fit) if args.steps else fit)
    log.warning("--max-seconds %s: %.3f s/step, training %d steps", args.max_seconds, rate, chosen)
    return chosen


def _disabled(args: TrainDrafterArgs):
    return None if args.progress is None else not args.progress


def _batch(train: list[Sample], step: int, per_epoch: int, args: TrainDrafterArgs) -> list[Sample]:
    """Batches follow a permutation per epoch that depends only on (seed, epoch): a resumed run
    needs no data-loader state to continue exactly where it stopped."""
    epoch, index = divmod(step, per_epoch)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(args.seed * 7919 + epoch))
    picked = order[index * args.batch_size:(index + 1) * args.batch_size].tolist()
    return [train[i] for i in picked]


@torch.no_grad()
def _evaluate(drafter, target, head, features, held: list[Sample], cfg: DFlashConfig, weights, args,
              eval_batch: int, autocast) -> EvalResult | None:
    """Blocks anchored at every held-out position (args.anchors per forward), then the engine's
    walk over each trained-on span: tau as `lucebox` would measure it on this text."""
    embed = partial(drafter.block_input, target)
    if not held:
        return None
    vocab, B = target.config.vocab_size, cfg.block_size
    tokens = steps = 0
    slots, loss, weight = None, 0.0, 0.0
    for first_sample in range(0, len(held), eval_batch):
        ids, lengths, mask = collate(held[first_sample:first_sample + eval_batch], target.device)
        feats, greedy = features(ids, lengths, greedy=True)
        S, T = ids.shape
        candidates = blocks.anchor_candidates(lengths, mask)
        accepted_at = torch.zeros(S, T, dtype=torch.int64)
        for first in range(0, T, args.anchors):
            anchors = torch.arange(first, min(T, first + args.anchors), device=ids.device).expand(S, -1)
            keep = candidates.gather(1, anchors)
            if not bool(keep.any()):  # all prompt (long contexts, short continuations): nothing to score
                continue
            labels, valid = blocks.block_targets(ids, lengths, mask, anchors, keep, B)
            with autocast:
                hidden = blocks.draft_hidden(drafter, embed, feats, ids, anchors, cfg.mask_token_id)
                total, w, _ = blocks.weighted_ce(head, hidden, labels, valid, weights, vocab)
                selector = getattr(drafter, "candidate_selector", None)  # DFlash2: its chain is the draft
                drafted = None if selector is None else selector_drafts(selector, head, hidden, ids.gather(1, anchors),
                                                                         vocab)
                acc, per_slot = blocks.acceptance(head, hidden, greedy, lengths, anchors, keep, vocab,
                                                  drafted=drafted)
            accepted_at[:, first:first + anchors.shape[1]] = acc.cpu()
            slots = per_slot if slots is None else slots + per_slot
            loss += float(total)
            weight += float(w)
        for row, n, trained in zip(accepted_at.tolist(), lengths.tolist(), mask.cpu().tolist()):
            for begin, end in _spans(trained[:n]):
                t, k = blocks.walk(row, max(1, begin), end)
                tokens, steps = tokens + t, steps + k
    if steps == 0:
        return None
    hits, counts = slots.double().cpu()
    return EvalResult(tokens / steps, (hits / counts.clamp(min=1)).tolist(), loss / max(weight, 1e-9), steps)


def _spans(trained: list[bool]) -> list[tuple[int, int]]:
    """Maximal runs [begin, end) of trained-on positions: the text the target writes itself."""
    spans, begin = [], None
    for i, t in enumerate(trained + [False]):
        if t and begin is None:
            begin = i
        elif not t and begin is not None:
            spans.append((begin, i))
            begin = None
    return spans


def _record(step: int, result: EvalResult, train_loss: float | None) -> dict:
    return {"step": step, "tau": result.tau, "eval_loss": result.loss, "slot_accuracy": result.slot_accuracy,
            "verify_steps": result.steps, "train_loss": train_loss}


def _append_log(out: Path, record: dict) -> None:
    with open(out / LOG_FILE, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def _eval_files(args: TrainDrafterArgs, files: list[Path]) -> list[Path] | None:
    """--eval-data's files (None without it); none of them may also be trained on."""
    if args.eval_data is None:
        return None
    eval_files = collect_files(args.eval_data, "--eval-data")
    trained = {f.resolve() for f in files}
    both = [f for f in eval_files if f.resolve() in trained]
    if both:
        raise RequestError(f"--eval-data {both[0]} is also in --data: the held-out figures would be measured "
                           "on text the drafter trains on")
    return eval_files


def _samples(args: TrainDrafterArgs, files: list[Path], eval_files: list[Path] | None, loaded,
             out: Path) -> tuple[list[Sample], list[Sample]]:
    prompt_len = args.prompt_len or max(4, args.seq_len // 4)

    def load(regenerate: bool) -> tuple[list[Sample], list[Sample]]:
        return load_samples(files, loaded.tokenizer, args.seq_len, args.eval_fraction, args.eval_samples,
                            args.max_samples, regenerate, prompt_len, args.seed, eval_files)

    if not args.regenerate:
        return load(False)
    # Regenerating is the slow part of a run: keep its result, keyed by everything it depends on.
    settings = {"seq_len": args.seq_len, "prompt_len": prompt_len, "seed": args.seed,
                "max_samples": args.max_samples, "eval_samples": args.eval_samples,
                "eval_fraction": args.eval_fraction, "dtype": str(loaded.model.dtype)}
    if args.regen_tokens is not None:  # only then: earlier caches keep their keys
        settings["regen_tokens"] = args.regen_tokens
    if eval_files is not None:  # only then: caches made without --eval-data keep their keys
        settings["eval_data"] = fingerprint(args.target, eval_files, {})
    key = fingerprint(args.target, files, settings)
    cached = load_cached(out / REGEN_FILE, key)
    if cached is not None:
        return cached
    train, held = load(True)
    train = regenerate(loaded, train, args.seq_len, args.regen_batch, "Regenerating train", args.regen_tokens)
    held = regenerate(loaded, held, args.seq_len, args.regen_batch, "Regenerating held-out", args.regen_tokens)
    if not train:
        raise RequestError("--regenerate: the target produced no continuation to train on")
    save_cached(out / REGEN_FILE, key, train, held)
    return train, held


def _save_state(path: Path, drafter, optimizer, schedule, step: int, cfg: DFlashConfig, history: list) -> None:
    """Atomically (temp file + rename): an interrupted save leaves the previous state intact."""
    rng = {"torch": torch.get_rng_state(),
           "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
    state = {"version": 1, "step": step, "drafter_config": cfg.to_dict(), "model": drafter.state_dict(),
             "optimizer": optimizer.state_dict(), "scheduler": schedule.state_dict(), "rng": rng,
             "history": history}
    tmp = path.with_name(path.name + ".partial")
    torch.save(state, tmp)
    os.replace(tmp, path)


def _load_state(path: Path, cfg: DFlashConfig) -> dict:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{path}: cannot read the training state ({e})") from None
    saved = state.get("drafter_config") or {}
    wanted = cfg.to_dict()
    diff = [k for k in sorted(set(saved) | set(wanted)) if saved.get(k) != wanted.get(k)]
    if diff:
        shown = ", ".join(f"{k}: saved {saved.get(k)!r}, now {wanted.get(k)!r}" for k in diff[:4])
        raise RequestError(f"--resume: the drafter in {path} differs from the one these flags describe ({shown}); "
                           "resume with the flags of the original run")
    return state


def main(args) -> int:
    names = set(TrainDrafterArgs.__dataclass_fields__) - {"progress"}
    result = train_drafter(TrainDrafterArgs(**{k: getattr(args, k) for k in names if hasattr(args, k)}))
    where = result.out
    if result.final is not None:
        print(f"held-out: {result.final.summary()} ({result.final.steps} verify steps replayed)", file=sys.stderr)
    print(f"wrote {where} (steps {result.start_step}..{result.step}, {result.seconds:.0f} s); use it with "
          f"speculative_config={{'method': 'dflash', 'model': '{where}'}}", file=sys.stderr)
    return 0
