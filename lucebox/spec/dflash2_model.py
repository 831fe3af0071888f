"""The DFlash2 drafter (`DFlash2DraftModel`, z-lab / Inco AI): the DFlash drafter plus a grouped
dynamic causal convolution around every attention and MLP sub-layer and a candidate selector that
turns the block's independent per-slot guesses into one chain.

Convolution (per layer: `attention_conv`, `mlp_conv`; taps K = conv_kernel_size, groups of
G = conv_group_size channels). With x the sub-layer's input (after its RMSNorm) over the rows of
one block, `kernel_projection(x)` [rows, 2*K*d/G] is read as [rows, side, tap, group] (side 0:
before the sub-layer, side 1: after it). `prepare` convolves the input with side 0 and hands side 1
to `finish`, which convolves the sub-layer's output with it:
    out[i, c] = sum_t (base_kernel[side, t, c] + delta[i, side, t, c // G]) * v[i - t, c]
where rows before the block's first row count as zero (taps never cross a block start). Only the
block rows are convolved; the context K/V (the target's features) are untouched.

Selector: at draft slot s (1..B-1) keep the top-K candidates c of the slot's (processed) logits;
score each as unary[c] + <A[pred] * P h_s, B[c]>, A = predecessor_codebook, B =
successor_codebook ([vocab, rank]), P = hidden_projection [rank, d], h_s the slot's final-normed
hidden state (what the LM head reads), pred the token chosen at the slot before (the anchor for
slot 1). Greedy: take the argmax and walk on. T > 0: q_s = softmax over the K candidates, the token
drawn from q_s, walk on; q_s (zero outside the candidates) is the draft probability that chain
rejection sampling uses, so verification stays lossless.

Sourced (public ports of the reference, z-lab/dflash `07ebd93`: QEfficient's DFlash-2, vLLM's
DFlash2 #52816 and its Kimi and ARM-CPU adaptations, exllamav3 #334/#379, SGLang #35371,
speculators #1006): the prepare/finish split and one projection feeding both sides; the
[side, tap, group] order of the projection and base_kernel[side]; the sum over taps of
(base + delta) times the row t back, zero at the block start; the normed sub-layer input as the
projection's input; the selector's score and walk from the anchor with the post-final-norm hidden
state of the scored slot; at T > 0, q = softmax((unary + transition) / T) over the candidates
(a port's `select_stochastic_path`, "returns q over the K candidates" in SGLang #35371); codebook
tensor names without `.weight`.
Differences and assumptions (each in one place here):
  * T > 0 draws (`CandidateSelector.walk`): by inverse CDF from the sequence's own generator; the
    reference draws a keyed Gumbel argmax (same distribution, other random numbers).
  * The unary term and the candidates are the logits as lucebox's Sampler processes them for the
    sequence (logit_bias, penalties, temperature, top-k/p, min-p: the transition is then divided
    by T separately). With temperature alone this is exactly the reference; filtered candidates
    get q = 0.
  * selector_top_k larger than the vocabulary (tiny test models) keeps the whole vocabulary.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import CheckpointError
from .dflash_model import DFlashConfig, DFlashDrafter, layer_mask
from .draft_attention import Context

ARCHITECTURE = "DFlash2DraftModel"
EXTRA_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def is_dflash2(raw: dict) -> bool:
    """Whether a drafter config.json declares DFlash2 (by its architectures field)."""
    return ARCHITECTURE in (raw.get("architectures") or [])


@dataclass
class DFlash2Config(DFlashConfig):
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16

    @classmethod
    def from_dict(cls, raw: dict, where: str = "config.json") -> DFlash2Config:
        base = DFlashConfig.from_dict(raw, where)
        inner = raw.get("dflash_config") or {}
        extras = {}
        for key in EXTRA_KEYS:
            value = inner.get(key, raw.get(key))
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise CheckpointError(f"{where}: a DFlash2 drafter needs a positive integer {key} "
                                      f"(in dflash_config or at the top level), got {value!r:.80}")
            extras[key] = value
        cfg = cls(**vars(base), **extras)
        cfg.check(where)
        return cfg

    @classmethod
    def of(cls, base: DFlashConfig, **extras) -> DFlash2Config:
        cfg = cls(**{k: v for k, v in vars(base).items() if k not in EXTRA_KEYS}, **extras)
        cfg.check("the DFlash2 drafter")
        return cfg

    def check(self, where: str) -> None:
        d = self.model.hidden_size
        if d % self.conv_group_size:
            raise CheckpointError(f"{where}: conv_group_size {self.conv_group_size} does not divide the hidden "
                                  f"size {d}")
        if self.conv_kernel_size > self.block_size:
            raise CheckpointError(f"{where}: conv_kernel_size {self.conv_kernel_size} exceeds the block of "
                                  f"{self.block_size}")

    def to_dict(self) -> dict:
        raw = super().to_dict()
        raw["architectures"] = [ARCHITECTURE]
        raw["dflash_config"] |= {key: getattr(self, key) for key in EXTRA_KEYS}
        return raw


def read_config(path: Path) -> DFlashConfig:
    """A drafter directory's config: DFlash2Config when its architectures say DFlash2, else DFlashConfig."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{file}: config.json not found (is {path} a DFlash drafter directory?)")
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from None
    return (DFlash2Config if is_dflash2(raw) else DFlashConfig).from_dict(raw, str(file))


def build_drafter(cfg: DFlashConfig) -> DFlashDrafter:
    return DFlash2Drafter(cfg) if isinstance(cfg, DFlash2Config) else DFlashDrafter(cfg)


class GroupedDynamicConv(nn.Module):
    """The two-sided grouped dynamic causal depthwise convolution wrapping one sub-layer."""

    def __init__(self, hidden: int, taps: int, group: int):
        super().__init__()
        self.taps, self.group, self.groups = taps, group, hidden // group
        self.base_kernel = nn.Parameter(torch.empty(2, taps, hidden))  # [side, tap, channel]
        self.kernel_projection = nn.Linear(hidden, 2 * taps * self.groups, bias=False)

    def prepare(self, x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x [rows, hidden], consecutive blocks of `block` rows -> (x convolved with side 0, the
        side-1 deltas [rows, taps, groups] that `finish` applies to the sub-layer's output)."""
        delta = self.kernel_projection(x).view(x.shape[0], 2, self.taps, self.groups)
        return self._convolve(x, delta[:, 0], self.base_kernel[0], block), delta[:, 1]

    def finish(self, y: torch.Tensor, delta: torch.Tensor, block: int) -> torch.Tensor:
        return self._convolve(y, delta, self.base_kernel[1], block)

    def _convolve(self, v: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block: int) -> torch.Tensor:
        rows, hidden = v.shape
        if rows % block:
            raise ValueError(f"{rows} rows are not whole blocks of {block}")
        grouped = v.view(rows, self.groups, self.group)
        weight = base.view(1, self.taps, self.groups, self.group).to(v.dtype) + delta.to(v.dtype).unsqueeze(-1)
        out = weight[:, 0] * grouped
        in_block = torch.arange(rows, device=v.device) % block
        for t in range(1, self.taps):
            shifted = F.pad(grouped[:-t], (0, 0, 0, 0, t, 0))  # row i holds row i - t
            out = out + weight[:, t] * shifted * (in_block >= t).to(v.dtype).view(-1, 1, 1)
        return out.view(rows, hidden)


@dataclass
class Walk:
    tokens: torch.Tensor  # [k] the chain drafted (device)
    candidates: torch.Tensor  # [k, K] each slot's candidates
    q: torch.Tensor | None  # [k, K] the distribution each token was drawn from; None when greedy


class CandidateSelector(nn.Module):
    def __init__(self, hidden: int, vocab: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab, rank))
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)

    def transition(self, predecessors: torch.Tensor, projected: torch.Tensor, candidates: torch.Tensor
                   ) -> torch.Tensor:
        """<A[pred] * P h, B[c]> in float32: predecessors [n], projected (P h) [n, rank],
        candidates [n, K] -> [n, K]."""
        a = self.predecessor_codebook[predecessors].float() * projected.float()
        return torch.einsum("nr,nkr->nk", a, self.successor_codebook[candidates].float())

    def walk(self, hidden: torch.Tensor, anchor: torch.Tensor | int,
             logits: torch.Tensor | Callable[[int, list[int]], torch.Tensor], temperature: float = 0.0,
             generator: torch.Generator | None = None) -> Walk:
        """The chain over slots 1..k. hidden [k, d]: the slots' final-normed hidden states; logits:
        the slots' processed logits [k, vocab], or a function (slot, tokens drafted before it) ->
        [vocab] for processing that reads the draft's own history. temperature 0: greedy."""
        if isinstance(logits, torch.Tensor):
            if temperature > 0:
                return self._sampled_walk(hidden, anchor, logits, temperature, generator)
            return self._greedy_walk(hidden, anchor, logits)
        k = hidden.shape[0]
        projected = self.hidden_projection(hidden)
        pred = torch.as_tensor(anchor, device=hidden.device).view(1)
        tokens, cands, qs, drafted = [], [], [], []
        for s in range(k):
            row = logits[s] if isinstance(logits, torch.Tensor) else logits(s, drafted)
            unary, cand = row.float().topk(min(self.top_k, row.shape[-1]))
            step = self.transition(pred, projected[s:s + 1], cand[None])[0]
            if temperature > 0:  # unary is already divided by T (the Sampler's processing)
                q = torch.softmax(unary + step / temperature, -1)
                where = generator.device if generator is not None else q.device  # a seeded sequence's own draws
                u = torch.rand(1, device=where, generator=generator).to(q.device) * q.sum()
                pick = torch.searchsorted(q.cumsum(-1), u).clamp_(max=q.shape[0] - 1)
                qs.append(q)
            else:
                pick = (unary + step).argmax().view(1)
            pred = cand[pick]
            tokens.append(pred)
            cands.append(cand)
            if not isinstance(logits, torch.Tensor):
                drafted.append(int(pred))
        return Walk(torch.cat(tokens), torch.stack(cands), torch.stack(qs) if qs else None)


    def lattice(self, hidden: torch.Tensor, anchor: torch.Tensor | int, logits: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every transition score at once, for trees over one pass: candidates [k, K] and scores
        [k, K, K], scores[s, p, c] = unary[s, c] + <A[pred] * P h_s, B[candidates[s, c]]> with pred
        candidates[s - 1, p] (the anchor for every p at s = 0). Row p of slot s is what `walk`
        scores at slot s after choosing candidate p at slot s - 1."""
        unary, candidates = logits.float().topk(min(self.top_k, logits.shape[-1]), dim=-1)
        return candidates, unary[:, None, :] + self._transitions(hidden, anchor, candidates)

    def _transitions(self, hidden: torch.Tensor, anchor: torch.Tensor | int, candidates: torch.Tensor
                     ) -> torch.Tensor:
        """[k, K, K] float32: [s, p, c] = <A[pred] * P h_s, B[candidates[s, c]]>, pred = candidates[s - 1, p]
        (the anchor for every p at s = 0)."""
        K = candidates.shape[1]
        anchor = torch.as_tensor(anchor, device=hidden.device).view(1, 1).expand(1, K)
        preds = torch.cat([anchor, candidates[:-1]])  # [k, K]
        a = self.predecessor_codebook[preds].float() * self.hidden_projection(hidden).float()[:, None]
        return torch.einsum("spr,scr->spc", a, self.successor_codebook[candidates].float())

    def _greedy_walk(self, hidden: torch.Tensor, anchor: torch.Tensor | int, logits: torch.Tensor) -> Walk:
        """`walk` at temperature 0 over the lattice computed at once: a slot's choice is the argmax of the
        lattice row of the one before it, two launches a slot and no host sync (it runs inside the draft
        graphs), where the slot-by-slot walk took a top-k over the vocabulary and a transition each."""
        candidates, scores = self.lattice(hidden, anchor, logits)  # row 0 of slot 0: the anchor's, as every row
        pick = torch.zeros(1, dtype=torch.long, device=scores.device)
        picks = []
        for s in range(scores.shape[0]):
            pick = scores[s].index_select(0, pick).argmax(-1)
            picks.append(pick)
        chosen = torch.cat(picks)
        return Walk(candidates.gather(1, chosen[:, None])[:, 0], candidates, None)

    def _sampled_walk(self, hidden: torch.Tensor, anchor: torch.Tensor | int, logits: torch.Tensor,
                      temperature: float, generator: torch.Generator | None) -> Walk:
        """`walk` at temperature > 0 from the whole lattice at once: each slot's q given every predecessor
        and one uniform a slot on the device, the path through them on the host after one copy (slot by
        slot it took a dozen launches a slot, which a small target's step cannot hide)."""
        unary, candidates = logits.float().topk(min(self.top_k, logits.shape[-1]), dim=-1)
        # unary is already divided by T (the Sampler's processing)
        q = torch.softmax(unary[:, None, :] + self._transitions(hidden, anchor, candidates) / temperature, -1)
        k = q.shape[0]
        where = generator.device if generator is not None else q.device  # a seeded sequence's own draws
        u = torch.rand(k, device=where, generator=generator).to(q.device)
        cdf = q.cumsum(-1)
        cdf_host, u_host = cdf.cpu(), u.cpu()
        picks, row = [], 0  # at slot 0 every row is the anchor's
        for s in range(k):
            threshold = u_host[s:s + 1] * cdf_host[s, row, -1]
            row = int(torch.searchsorted(cdf_host[s, row], threshold).clamp_(max=q.shape[-1] - 1))
            picks.append(row)
        slots = torch.arange(k, device=q.device)
        chosen = torch.tensor(picks, device=q.device)
        before = torch.tensor([0] + picks[:-1], device=q.device)
        return Walk(candidates[slots, chosen], candidates, q[slots, before])

    def tree_log_probs(self, hidden: torch.Tensor, anchor: torch.Tensor | int, logits: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """The lattice as conditional log-probs for a draft tree (spec/tree.py build_lattice_tree):
        candidates [k, K] and [k, K, K] = log softmax over the K candidates of the lattice's scores
        (the selector's q at temperature 1) + log of the slot's top-K share of the drafter's own
        distribution (the chance the token is a candidate at all)."""
        candidates, scores = self.lattice(hidden, anchor, logits)
        covered = logits.float().log_softmax(-1).gather(1, candidates).logsumexp(-1)
        return candidates, scores.log_softmax(-1) + covered[:, None, None]


class DFlash2Drafter(DFlashDrafter):
    def __init__(self, cfg: DFlash2Config):
        super().__init__(cfg)
        m = cfg.model
        for layer in self.layers:
            layer.attention_conv = GroupedDynamicConv(m.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
            layer.mlp_conv = GroupedDynamicConv(m.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
        self.candidate_selector = CandidateSelector(m.hidden_size, m.vocab_size, cfg.selector_rank,
                                                    cfg.selector_top_k)

    def reset_dflash2_parameters(self, std: float = 0.02) -> None:
        """Training start: identity convolutions (tap 0 = 1, no deltas) and a zero transition
        (successor codebook 0), so a fresh DFlash2 drafter computes exactly its DFlash backbone."""
        with torch.no_grad():
            for layer in self.layers:
                for conv in (layer.attention_conv, layer.mlp_conv):
                    conv.base_kernel.zero_()
                    conv.base_kernel[:, 0] = 1.0
                    conv.kernel_projection.weight.zero_()
            sel = self.candidate_selector
            sel.predecessor_codebook.normal_(0.0, std)
            sel.successor_codebook.zero_()
            sel.hidden_projection.weight.normal_(0.0, std)

    def blocks(self, x: torch.Tensor, positions: torch.Tensor, context: list[Context],
               context_positions: torch.Tensor, mask: torch.Tensor | None = None,
               position_bound: int | None = None) -> torch.Tensor:
        """DFlashDrafter.blocks with the convolutions; x holds whole blocks of block_size rows."""
        block = self.config.block_size
        cos, sin = self.rope.lookup(positions, x.dtype, position_bound)
        key_positions = torch.cat([context_positions, positions])
        for layer, ctx in zip(self.layers, context):
            attn = layer.self_attn
            h, after = layer.attention_conv.prepare(layer.input_layernorm(x), block)
            k, v = attn.key_value(h, cos, sin)
            o = attn.over_context(h, cos, sin, ctx, k, v, layer_mask(attn, mask, positions, key_positions))
            x = x + layer.attention_conv.finish(o, after, block)
            h, after = layer.mlp_conv.prepare(layer.post_attention_layernorm(x), block)
            x = x + layer.mlp_conv.finish(layer.mlp(h), after, block)
        return self.norm(x)

