"""Multi-anchor block training: every block of every sequence in one batched drafter forward.

Per sequence, N anchors a_n are drawn; block n is [token at a_n, MASK x (B-1)] at positions
a_n .. a_n+B-1. Its queries see the fused target context of positions < a_n (strictly before the
anchor, as at inference, where the anchor's own features are not known yet) and the B rows of
their own block, bidirectionally; never another block. This is exactly what `DFlashDrafter.blocks`
computes for one anchor over its cached context, done for all anchors at once.

Attention is split in two dense products instead of one [N*B, T + N*B] mask (mostly False):
block rows x context [S, H, N*B, T] under the "before the anchor" mask, and block rows x own block
[S, H, N, B, B]; one softmax runs over both parts. The cost is T + B keys per query, not T + N*B.
Everything is batched tensor code: no Python loop over anchors or sequences.

Evaluation drafts a block at every held-out position, scores each slot against the target's greedy
next token, and replays the engine's verify loop over the text (`walk`), so the reported tau is the
one `lucebox` measures when it decodes that text.
"""
from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def default_gamma(block_size: int) -> float:
    """The recipe's decay: 7 for B=16, 4 for B=8; linear in between, clamped outside."""
    return float(min(7.0, max(4.0, 4.0 + (block_size - 8) * 3.0 / 8.0)))


def slot_weights(block_size: int, gamma: float, device) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for slots k = 1..B-1: early slots matter more, since a rejection
    there discards every later draft."""
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def anchor_candidates(lengths: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[S, T] bool: positions that may anchor a block. An anchor needs context before it (a >= 1,
    as at inference, where the first anchor follows the prompt) and a trained-on token right
    after it."""
    T = mask.shape[1]
    pos = torch.arange(T, device=mask.device)
    nxt = torch.zeros_like(mask)
    nxt[:, :-1] = mask[:, 1:]
    return nxt & (pos >= 1) & (pos[None, :] < lengths[:, None] - 1)


def sample_anchors(candidates: torch.Tensor, num_anchors: int, generator: torch.Generator
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to num_anchors distinct candidates per sequence, uniformly: anchors [S, N] (sorted), keep
    [S, N] (False where a sequence had fewer candidates). The draw uses a CPU generator, so a
    resumed run draws the same anchors on any device."""
    S, T = candidates.shape
    n = max(1, min(num_anchors, T))
    scores = torch.rand(S, T, generator=generator).to(candidates.device)
    scores = scores.masked_fill(~candidates, -1.0)
    top, idx = scores.topk(n, dim=1)
    keep = top >= 0
    idx = torch.where(keep, idx, torch.zeros_like(idx))
    order = torch.argsort(torch.where(keep, idx, T), dim=1)
    return idx.gather(1, order), keep.gather(1, order)


def draft_hidden(drafter, embed, features: torch.Tensor, ids: torch.Tensor, anchors: torch.Tensor,
                 mask_token_id: int) -> torch.Tensor:
    """Final (normed) drafter hidden states of every block: [S, N, B, hidden].

    features [S, T, taps*hidden] target features of positions 0..T-1; ids [S, T]; anchors [S, N];
    embed: ids -> the block's input rows from the target's frozen embedding (DFlashDrafter.block_input).

    Norms, RoPE and the MLP are written out here in plain torch (the reference formulas of
    lucebox.kernels) rather than called through the drafter's modules: kernels/ may route those to
    GPU kernels that have no backward pass. The parameters are the drafter's own."""
    S, T, _ = features.shape
    N = anchors.shape[1]
    B = drafter.config.block_size
    device = features.device
    c = _rms(drafter.fc(features), drafter.hidden_norm)  # [S, T, D]: the context every layer projects
    D = c.shape[-1]
    ctx_pos = torch.arange(T, device=device)
    cos_c, sin_c = drafter.rope.lookup(ctx_pos, torch.float32)
    cos_c, sin_c = cos_c.repeat(S, 1), sin_c.repeat(S, 1)
    blk_pos = (anchors[..., None] + torch.arange(B, device=device)).reshape(-1)  # [S*N*B]
    cos_b, sin_b = drafter.rope.lookup(blk_pos, torch.float32)
    block_ids = torch.full((S, N, B), mask_token_id, dtype=torch.int64, device=device)
    block_ids[:, :, 0] = ids.gather(1, anchors)
    x = embed(block_ids).reshape(S * N * B, D)
    act = F.silu if drafter.config.activation == "silu" else partial(F.gelu, approximate="tanh")
    visible = ctx_pos[None, None, :] < anchors[..., None]  # [S, N, T]: context strictly before the anchor
    c_flat = c.reshape(S * T, D)
    for layer in drafter.layers:
        attn = layer.self_attn
        if attn.sliding_window is not None:
            raise NotImplementedError("training sliding-window draft layers")
        conv = getattr(layer, "attention_conv", None)  # DFlash2: block-local convs around each sub-layer
        h = _rms(x, layer.input_layernorm)
        if conv is not None:
            h, after = conv.prepare(h, B)
        k_c, v_c = _key_value(attn, c_flat, cos_c, sin_c)
        k_b, v_b = _key_value(attn, h, cos_b, sin_b)
        q = _rope(_rms(attn.q_proj(h).view(-1, attn.num_heads, attn.head_dim), attn.q_norm), cos_b, sin_b)
        o = _block_attention(q, k_c, v_c, k_b, v_b, visible, attn.scale, attn.causal)
        o = attn.o_proj(o)
        x = x + (conv.finish(o, after, B) if conv is not None else o)
        mlp, conv = layer.mlp, getattr(layer, "mlp_conv", None)
        h = _rms(x, layer.post_attention_layernorm)
        if conv is not None:
            h, after = conv.prepare(h, B)
        o = mlp.down_proj(act(mlp.gate_proj(h)) * mlp.up_proj(h))
        x = x + (conv.finish(o, after, B) if conv is not None else o)
    return _rms(x, drafter.norm).view(S, N, B, D)


def _rms(x: torch.Tensor, norm) -> torch.Tensor:
    """RMSNorm in float32, cast back to the input dtype, then scaled (kernels/norm.py's formula)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.eps)
    return norm.weight * h.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on x [rows, heads, d] (kernels/rope.py's formula)."""
    half = x.shape[-1] // 2
    return x * cos[:, None, :] + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin[:, None, :]


def _key_value(attn, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    """DraftAttention.key_value: K normed per head and rotated, V as projected."""
    k = _rms(attn.k_proj(x).view(-1, attn.num_kv_heads, attn.head_dim), attn.k_norm)
    return _rope(k, cos, sin), attn.v_proj(x).view(-1, attn.num_kv_heads, attn.head_dim)


def _block_attention(q, k_c, v_c, k_b, v_b, visible, scale: float, causal: bool = False) -> torch.Tensor:
    """q, k_b, v_b: rows of all blocks [S*N*B, heads, d]; k_c, v_c: context rows [S*T, kv_heads, d];
    visible [S, N, T]; causal: a block row sees its block's rows up to itself only (else all).
    Returns [S*N*B, heads*d]."""
    S, N, T = visible.shape
    H, hd = q.shape[1], q.shape[2]
    B = q.shape[0] // (S * N)
    g = H // k_c.shape[1]
    dtype = torch.get_autocast_dtype(q.device.type) if torch.is_autocast_enabled(q.device.type) else q.dtype

    def heads(t, *lead):  # [rows, kv_heads, d] -> [S, H, *lead, d]
        t = t.to(dtype).view(S, *lead, -1, hd).movedim(-2, 1)
        return t.repeat_interleave(g, dim=1) if g > 1 else t

    q = (q * scale).to(dtype).view(S, N * B, H, hd).transpose(1, 2)  # [S, H, N*B, d], pre-scaled
    kc, vc = heads(k_c, T), heads(v_c, T)  # [S, H, T, d]
    kb, vb = heads(k_b, N, B), heads(v_b, N, B)  # [S, H, N, B, d]
    s_ctx = (q @ kc.transpose(-1, -2)).view(S, H, N, B, T)
    s_ctx = s_ctx.masked_fill(~visible[:, None, :, None, :], float("-inf"))
    s_blk = q.view(S, H, N, B, hd) @ kb.transpose(-1, -2)  # [S, H, N, B, B]
    if causal:
        later = torch.ones(B, B, dtype=torch.bool, device=q.device).triu(1)
        s_blk = s_blk.masked_fill(later, float("-inf"))
    # One softmax over [context | own block], in float32 like the reference attention kernels.
    p = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1), dim=-1, dtype=torch.float32).to(dtype)
    o = p[..., :T].reshape(S, H, N * B, T) @ vc + (p[..., T:] @ vb).view(S, H, N * B, hd)
    return o.transpose(1, 2).reshape(S * N * B, H * hd)


def block_targets(ids: torch.Tensor, lengths: torch.Tensor, mask: torch.Tensor, anchors: torch.Tensor,
                  keep: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """labels [S, N, B-1] (token at anchor+k for slot k) and valid [S, N, B-1] (inside the
    sequence, trained-on, anchor kept)."""
    S, T = ids.shape
    pos = anchors[..., None] + torch.arange(1, block_size, device=ids.device)  # [S, N, B-1]
    inside = pos < lengths[:, None, None]
    flat = pos.clamp(max=T - 1).reshape(S, -1)
    labels = ids.gather(1, flat).view_as(pos)
    valid = inside & mask.gather(1, flat).view_as(pos) & keep[..., None]
    return labels, valid


def _chunk_loss(lm_head, h, y, w):
    logits = lm_head(h).float()
    ce = F.cross_entropy(logits, y, reduction="none")
    return (ce * w).sum(), (logits.argmax(-1) == y).sum()


def weighted_ce(lm_head, hidden: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, weights: torch.Tensor,
                vocab_size: int, budget_bytes: int = 1 << 28) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sum over valid slots of w_k * CE, the weight total, and the number of correct argmaxes.

    hidden [S, N, B, D] (slot 0, the anchor, is not scored). The LM head runs on row chunks of
    about budget_bytes of float32 logits, recomputed in the backward pass (checkpoint), so the
    full [rows, vocab] logits never exist at once."""
    rows = hidden[:, :, 1:][valid]
    y = labels[valid]
    w = weights.expand_as(valid)[valid]
    chunk = max(1, budget_bytes // (4 * vocab_size))
    total = rows.new_zeros((), dtype=torch.float32)
    correct = torch.zeros((), dtype=torch.int64, device=rows.device)
    for start in range(0, rows.shape[0], chunk):
        args = (rows[start:start + chunk], y[start:start + chunk], w[start:start + chunk])
        if torch.is_grad_enabled():
            loss, right = checkpoint(_chunk_loss, lm_head, *args, use_reentrant=False)
        else:
            loss, right = _chunk_loss(lm_head, *args)
        total = total + loss
        correct = correct + right
    return total, w.sum(), correct


@torch.no_grad()
def acceptance(lm_head, hidden: torch.Tensor, greedy: torch.Tensor, lengths: torch.Tensor, anchors: torch.Tensor,
               keep: torch.Tensor, vocab_size: int, budget_bytes: int = 1 << 28,
               drafted: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Offline greedy acceptance of each block. Slot k's draft (argmax) is accepted when it equals
    the target's greedy next token after position a+k-1 (greedy [S, T] = argmax of the target's
    logits at each position); a block commits its accepted prefix. On target-generated text
    (--regenerate) this is exactly what verification would accept.

    Returns (accepted prefix length per anchor [S, N], 0 where not kept; per-slot hits and
    counts [2, B-1]). drafted [S, N, B-1]: the drafts when they are not each slot's argmax (DFlash2)."""
    S, N, B, D = hidden.shape
    if drafted is None:
        rows = hidden[:, :, 1:].reshape(-1, D)
        chunk = max(1, budget_bytes // (4 * vocab_size))
        drafted = torch.cat([lm_head(rows[i:i + chunk]).argmax(-1) for i in range(0, rows.shape[0], chunk)])
        drafted = drafted.view(S, N, B - 1)
    pos = anchors[..., None] + torch.arange(1, B, device=hidden.device)  # token positions a+k
    inside = (pos < lengths[:, None, None]) & keep[..., None]
    target = greedy.gather(1, (pos - 1).clamp(max=greedy.shape[1] - 1).reshape(S, -1)).view_as(pos)
    match = (drafted == target) & inside
    accepted = match.long().cumprod(-1).sum(-1)
    per_slot = torch.stack([match.sum((0, 1)), inside.sum((0, 1))])
    return accepted, per_slot


def walk(accepted_at: list[int], start: int, length: int) -> tuple[int, int]:
    """Replay speculative decoding over one sequence: draft at `start`, commit the accepted prefix
    plus the bonus token, draft again at the next uncommitted position. Returns (tokens, steps);
    tokens / steps is the engine's tau on this text, which weighs each verify step once (an
    average over all anchor positions would count a long accepted run once per position in it)."""
    tokens = steps = 0
    a = start
    while a < length - 1:
        n = accepted_at[a]
        steps += 1
        tokens += n + 1
        a += n + 1
    return tokens, steps


def cosine_with_warmup(total_steps: int, warmup_fraction: float):
    """LR multiplier: linear warm-up over warmup_fraction of the steps, then cosine to zero."""
    warm = max(1, math.ceil(warmup_fraction * total_steps))

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress = (step - warm) / max(1, total_steps - warm)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor
