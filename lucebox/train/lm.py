"""Training a lucebox Transformer as a language model (the default model's pre-training and chat
stage), and dense batched work for training drafters (target features, regenerated continuations).
Inference runs on the paged engine; training needs a dense causal forward over fixed-size batches,
written here over the very same modules so trained weights load unchanged."""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from ..model.transformer import Transformer
from .paged_target import PagedTarget, needs_paged_forward


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, heads, d]; cos/sin [T, d]."""
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class DenseCache:
    """Per-layer K/V [B, max_len, kv_heads, head_dim] for batched greedy generation of equal-length
    prompts (train data regeneration): no pages, no scheduler, one tensor write per layer and step."""

    def __init__(self, model: Transformer, batch: int, max_len: int):
        cfg = model.config
        shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
        self.k = [torch.empty(shape, dtype=model.dtype, device=model.device) for _ in model.layers]
        self.v = [torch.empty(shape, dtype=model.dtype, device=model.device) for _ in model.layers]


def _mask(t: int, start: int, window: int | None, device) -> torch.Tensor | None:
    """Boolean [t, start+t] keep-mask for queries at start..start+t-1, or None when plain causal
    attention (is_causal, start 0) or full attention (one query) says it already."""
    if window is None and (start == 0 or t == 1):
        return None
    q_pos = torch.arange(start, start + t, device=device)[:, None]
    k_pos = torch.arange(start + t, device=device)[None, :]
    keep = k_pos <= q_pos
    if window is not None:
        keep &= (q_pos - k_pos) < window
    return keep


def dense_forward(model: Transformer, ids: torch.Tensor, capture_layers: tuple[int, ...] = (),
                  cache: DenseCache | None = None, start: int = 0):
    """ids [B, T] at positions start..start+T-1 -> final normed hidden states [B, T, hidden].

    Causal attention (and each layer's sliding window) over the cache's first `start` positions and
    the new tokens; without a cache, start must be 0. With capture_layers, also returns the residual
    stream after those layers (as the paged forward captures it for DFlash), concatenated on the
    last dimension. Models whose layers this does not cover (hybrids) run their own paged forward
    (train/paged_target.py; no cache argument: use PagedTarget itself)."""
    if needs_paged_forward(model):
        if cache is not None:
            raise ValueError("a hybrid model's incremental forward keeps its state in a PagedTarget")
        return PagedTarget(model, ids.shape[0], ids.shape[1]).forward(ids, 0, capture_layers)
    b, t = ids.shape
    x = model.embed_tokens(ids)
    cos, sin = model.rope.lookup(torch.arange(start, start + t, device=ids.device), x.dtype, start + t)
    captured = []
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).view(b, t, attn.num_heads, attn.head_dim)
        k = attn.k_proj(h).view(b, t, attn.num_kv_heads, attn.head_dim)
        v = attn.v_proj(h).view(b, t, attn.num_kv_heads, attn.head_dim)
        if attn.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        if cache is not None:
            cache.k[i][:, start:start + t] = k
            cache.v[i][:, start:start + t] = v
            k, v = cache.k[i][:, :start + t], cache.v[i][:, :start + t]
        mask = _mask(t, start, attn.sliding_window, ids.device)
        if t > 1 and attn.num_heads != attn.num_kv_heads:
            # Shared K/V heads repeated: torch's flash and memory-efficient kernels refuse enable_gqa, and
            # the math fallback holds [heads, t, t] scores (tens of GB at 64K tokens). One query row (a
            # decode step) keeps enable_gqa: its scores are small and the cache is not copied.
            k, v = (kv.repeat_interleave(attn.num_heads // attn.num_kv_heads, dim=2) for kv in (k, v))
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                           is_causal=mask is None and t > 1, scale=attn.scale, enable_gqa=True)
        x = x + attn.o_proj(o.transpose(1, 2).reshape(b, t, -1))
        h = layer.post_attention_layernorm(x)
        x = x + layer.mlp(h.view(b * t, -1)).view_as(h)  # token rows: a SparseMoE routes [tokens, hidden]
        if i in capture_layers:
            captured.append(x)
    hidden = model.norm(x)
    if not capture_layers:
        return hidden
    return hidden, torch.cat(captured, dim=-1)


@torch.inference_mode()
def greedy_generate(model: Transformer, prompts: torch.Tensor, max_new: int, stop_ids: set[int] | frozenset = frozenset()
                    ) -> list[list[int]]:
    """Argmax continuations of equal-length prompts [B, P]: up to max_new tokens each, ending after
    the first stop token. Stops early once every row has stopped."""
    b, p = prompts.shape
    if max_new <= 0:
        return [[] for _ in range(b)]
    paged = PagedTarget(model, b, p + max_new) if needs_paged_forward(model) else None
    cache = None if paged is not None else DenseCache(model, b, p + max_new)

    def forward(ids, start):
        return paged.forward(ids, start) if paged is not None else dense_forward(model, ids, cache=cache, start=start)
    stops = torch.tensor(sorted(stop_ids), dtype=torch.int64, device=prompts.device)
    hidden = forward(prompts, 0)
    out = torch.empty(b, max_new, dtype=torch.int64, device=prompts.device)
    done = torch.zeros(b, dtype=torch.bool, device=prompts.device)
    n = 0
    for n in range(max_new):
        token = model.compute_logits(hidden[:, -1]).argmax(-1)
        out[:, n] = token
        done |= torch.isin(token, stops)
        if n + 1 == max_new or (n % 32 == 31 and bool(done.all())):  # a host sync every 32 tokens only
            break
        hidden = forward(token[:, None], p + n)
    rows = out[:, :n + 1].tolist()
    result = []
    for row in rows:
        end = next((j + 1 for j, tok in enumerate(row) if tok in stop_ids), len(row))
        result.append(row[:end])
    return result


def lm_loss(model: Transformer, ids: torch.Tensor, loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Next-token cross-entropy; loss_mask [B, T] marks the target positions that count."""
    hidden = dense_forward(model, ids[:, :-1])
    logits = model.compute_logits(hidden)
    targets = ids[:, 1:]
    if loss_mask is not None:
        targets = targets.masked_fill(~loss_mask[:, 1:], -100)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)


def train(model: Transformer, batches: Callable[[], Iterator], seconds: float, lr: float, warmup: float = 0.03,
          weight_decay: float = 0.1, log: Callable[[str], None] = print, min_lr_ratio: float = 0.1) -> dict:
    """AdamW with warm-up then cosine decay over a wall-clock budget (so one GPU call fits its limit)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    fused = next(model.parameters()).is_cuda
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95), fused=fused)
    device_type = "cuda" if fused else "cpu"
    start, step, tokens, last_log = time.time(), 0, 0, 0.0
    history = []
    for batch in batches():
        elapsed = (time.time() - start) / seconds
        if elapsed >= 1.0:
            break
        scale = elapsed / warmup if elapsed < warmup else \
            min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * (elapsed - warmup) / (1 - warmup)))
        for group in opt.param_groups:
            group["lr"] = lr * scale
        ids, mask = batch if isinstance(batch, tuple) else (batch, None)
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=fused):
            loss = lm_loss(model, ids, mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        tokens += ids.numel()
        if time.time() - last_log > 15 or step == 1:
            last_log = time.time()
            value = loss.item()
            history.append((step, round(time.time() - start, 1), value))
            log(f"step {step} t={time.time() - start:.0f}s loss {value:.3f} tok/s {tokens / (time.time() - start):,.0f}")
    return {"steps": step, "tokens": tokens, "seconds": time.time() - start, "history": history}


@torch.no_grad()
def evaluate(model: Transformer, batches: list, device) -> float:
    """Mean next-token loss (nats) over held-out batches."""
    total, count = 0.0, 0
    for ids in batches:
        ids = ids.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            total += lm_loss(model, ids).item() * (ids.shape[1] - 1) * ids.shape[0]
        count += (ids.shape[1] - 1) * ids.shape[0]
    return total / count
