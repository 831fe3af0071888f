"""What a drafter training run is made of: its flags, the drafter's shape derived from the target,
and the target's tapped features."""
from __future__ import annotations

import copy
import dataclasses

import torch

from ..errors import CheckpointError, RequestError
from ..model.config import ModelConfig
from ..model.transformer import MLP, Attention
from ..spec.dflash2_model import DFlash2Config, DFlash2Drafter, build_drafter
from ..spec.dflash_model import DFlashConfig, DFlashDrafter
from .args import TrainDrafterArgs
from .lm import dense_forward

MASK_NAMES = ("<|mask|>", "<|MASK|>", "<mask>", "[MASK]", "<|mask_token|>")
MAX_DEFAULT_TAPS = 5  # the published drafters tap five layers


def default_taps(num_layers: int) -> list[int]:
    """The reference's spread: N = min(5, L-1) taps at 1 + k*floor((L-2)/(N-1)), from layer 1 up
    to about L-3 (L=36 -> [1, 9, 17, 25, 33]); one tap (L <= 2) sits at L//2. Shallow targets get
    fewer taps so that they stay distinct."""
    n = min(MAX_DEFAULT_TAPS, max(1, num_layers - 1))
    if n == 1:
        return [min(num_layers // 2, num_layers - 1)]
    step = (num_layers - 2) // (n - 1)
    return [1 + k * step for k in range(n)]


def parse_taps(spec: str | list[int], num_layers: int) -> list[int]:
    if isinstance(spec, str) and spec.strip().lower() == "auto":
        return default_taps(num_layers)
    try:
        taps = [int(t) for t in spec.split(",")] if isinstance(spec, str) else [int(t) for t in spec]
    except ValueError:
        raise RequestError(f"--taps {spec!r}: give 'auto' or comma-separated layer indices like 1,3,5") from None
    bad = [t for t in taps if not 0 <= t < num_layers]
    if bad:
        raise RequestError(f"--taps: layer(s) {bad} outside the target's {num_layers} layers (0..{num_layers - 1})")
    if len(set(taps)) != len(taps) or not taps:
        raise RequestError(f"--taps {spec!r}: give each layer once")
    return taps


def resolve_mask_token(spec: str | int, tokenizer, vocab_size: int) -> int:
    """A vocabulary token named like <|mask|> when there is one, else the embedding's last row.
    Either way an existing row: the embedding is never resized (the row's value does not matter,
    the drafter learns against it as a constant)."""
    if isinstance(spec, str) and spec.strip().lower() == "auto":
        for name in MASK_NAMES:
            i = tokenizer.token_to_id(name)
            if i is not None and 0 <= i < vocab_size:
                return i
        return vocab_size - 1
    try:
        value = int(spec)
    except (TypeError, ValueError):
        raise RequestError(f"--mask-token-id {spec!r}: give 'auto' or a token id") from None
    if not 0 <= value < vocab_size:
        raise RequestError(f"--mask-token-id {value} is outside the target's embedding (0..{vocab_size - 1}); "
                           "the mask must be an existing row, the embedding is never resized")
    return value


def drafter_config(target: ModelConfig, tokenizer, args: TrainDrafterArgs, start: DFlashConfig | None = None
                   ) -> DFlashConfig:
    """Width = the target's hidden size (the drafter shares its embedding and LM head); attention and
    FFN shapes default to the target's. RoPE is the target's, scaling included: the drafter serves
    the target's whole context (a YaRN-extended target's 64K positions) at the same positions.
    With `start` (--init-drafter), that drafter's shape, taps, block size and mask token are kept.
    --arch dflash2 makes it a DFlash2Config (the published conv sizes; the selector's flags)."""
    cfg = _base_config(target, tokenizer, args, start)
    if args.arch == "dflash2" and not isinstance(cfg, DFlash2Config):
        try:
            cfg = DFlash2Config.of(cfg, conv_kernel_size=2, conv_group_size=16, selector_rank=args.selector_rank,
                                   selector_top_k=args.selector_top_k)
        except CheckpointError as e:
            raise RequestError(f"--arch dflash2: {e}") from None
    return cfg


def _base_config(target: ModelConfig, tokenizer, args: TrainDrafterArgs, start: DFlashConfig | None
                 ) -> DFlashConfig:
    if start is not None:
        cfg = copy.deepcopy(start)
        cfg.model.rope = dataclasses.replace(target.rope)
        cfg.model.max_position_embeddings = target.max_position_embeddings
        cfg.num_target_layers = target.num_layers
        return cfg
    heads = args.heads or target.num_heads
    kv_heads = args.kv_heads or target.num_kv_heads
    if args.kv_heads is None and heads % kv_heads:
        kv_heads = heads  # --heads alone: keep it valid rather than inherit a grouping that does not divide
    model = ModelConfig(
        family="qwen3", vocab_size=target.vocab_size, hidden_size=target.hidden_size,
        intermediate_size=args.intermediate_size or target.intermediate_size, num_layers=args.layers,
        num_heads=heads, num_kv_heads=kv_heads,
        head_dim=args.head_dim or target.head_dim, rms_norm_eps=target.rms_norm_eps,
        max_position_embeddings=target.max_position_embeddings, rope=dataclasses.replace(target.rope),
        qk_norm=True, tie_word_embeddings=True)
    # A soft-capping target (Gemma 4) gives its drafter the same cap, as z-lab's Gemma 4 drafter has.
    return DFlashConfig(model, parse_taps(args.taps, target.num_layers),
                        resolve_mask_token(args.mask_token_id, tokenizer, target.vocab_size),
                        args.block_size, target.num_layers,
                        final_logit_softcapping=getattr(target, "final_logit_softcapping", None))


def init_drafter(cfg: DFlashConfig, device, seed: int, target=None, start: DFlashDrafter | None = None
                 ) -> DFlashDrafter:
    """float32 master weights (bf16 compute comes from autocast); HF's initialiser: N(0, 0.02)
    matrices, unit norms. With `target`, the draft layers start as copies of its last layers
    instead (init_from_target); with `start`, as that trained drafter's weights (--init-drafter).
    DFlash2's additions start as identities (reset_dflash2_parameters), so a DFlash `start` grows
    into a DFlash2 drafter computing exactly what it did."""
    torch.manual_seed(seed)
    drafter = build_drafter(cfg)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    if isinstance(drafter, DFlash2Drafter):
        drafter.reset_dflash2_parameters()
    if target is not None:
        init_from_target(drafter, target)
    if start is not None:
        missing, unexpected = drafter.load_state_dict({k: v.float() for k, v in start.state_dict().items()},
                                                      strict=False)
        grown = isinstance(drafter, DFlash2Drafter) and not isinstance(start, DFlash2Drafter)
        if unexpected or (missing and not grown):
            raise RequestError(f"--init-drafter: its tensors do not fit the drafter to train (missing "
                               f"{missing[:3]}, unexpected {unexpected[:3]})")
    return drafter.to(device)


def init_from_target(drafter: DFlashDrafter, target) -> None:
    """Start the n draft layers as copies of the target's last n layers (L-n .. L-1), and the
    context path so that the first draft layer sees exactly what the target's layer L-n reads:
    fc passes the tapped residual stream entering it (the output of layer L-n-1, which must be a
    tap) and hidden_norm is that layer's input norm. The first draft layer's context keys and
    values then equal the target's own at layer L-n; the layers start with the target's attention
    heads (induction heads included) instead of noise. A training aid: the block rows still
    start from plain embeddings, so the drafter must learn the rest."""
    cfg, tcfg = drafter.config, target.config
    n = cfg.model.num_layers
    first = tcfg.num_layers - n
    if first < 1:
        raise RequestError(f"--init-from-target: the drafter's {n} layers need a target deeper than that "
                           f"(it has {tcfg.num_layers})")
    fed_by = first - 1
    copied = target.layers[first:]
    if any(not isinstance(getattr(layer, "self_attn", None), Attention) or not isinstance(layer.mlp, MLP)
           for layer in copied):
        raise RequestError(f"--init-from-target copies the target's last {n} layers into the drafter's plain "
                           f"attention + dense MLP layers; the target's are not all of that kind (Gated DeltaNet, "
                           f"gated attention or sparse MoE layers): train without --init-from-target")
    if fed_by not in cfg.target_layer_ids:
        raise RequestError(f"--init-from-target: copying the target's last {n} layers needs layer {fed_by} "
                           f"(the one feeding layer {first}) among --taps, got {cfg.target_layer_ids}")
    shapes = ("num_heads", "num_kv_heads", "head_dim", "intermediate_size")
    if any(getattr(cfg.model, s) != getattr(tcfg, s) for s in shapes) or tcfg.qkv_bias or tcfg.o_bias \
            or tcfg.mlp_bias:
        raise RequestError("--init-from-target: the drafter's layers must have the target's shapes "
                           "(leave --heads/--kv-heads/--head-dim/--intermediate-size unset) and the target no biases")

    def copy(dst: torch.Tensor, src) -> None:
        src = src.dequantize(torch.float32) if not isinstance(src, torch.Tensor) else src  # a QuantTensor
        dst.copy_(src.detach().to(dst.dtype).view_as(dst))

    with torch.no_grad():
        for mine, theirs in zip(drafter.layers, copied):
            for name, p in mine.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")) and not tcfg.qk_norm:
                    continue  # the target has none: keep them at one
                module, _, attr = name.rpartition(".")
                copy(p, getattr(theirs.get_submodule(module), attr))
        hidden = tcfg.hidden_size
        drafter.fc.weight.zero_()
        column = cfg.target_layer_ids.index(fed_by) * hidden
        drafter.fc.weight[:, column:column + hidden] = torch.eye(hidden)
        copy(drafter.hidden_norm.weight, target.layers[first].input_layernorm.weight)
        copy(drafter.norm.weight, target.norm.weight)


def lm_head(model):
    """The target's LM head as hidden -> float32 logits, in plain differentiable torch: the loss
    backpropagates through it into the drafter. A quantised head (GGUF target) is dequantised once;
    it is frozen, and the engine's quantised matmul may have no backward pass."""
    head = model.embed_tokens if model.config.tie_word_embeddings else model.lm_head
    weight = head.weight
    if not isinstance(weight, torch.Tensor):  # a QuantTensor
        weight = weight.dequantize(model.dtype)
    weight = weight.detach()
    return lambda hidden: torch.nn.functional.linear(hidden, weight).float()


class TargetFeatures:
    """The target's tapped residual streams (and greedy next tokens) for whole sequences: one dense
    causal forward over the right-padded batch (train/lm.dense_forward; padding sits after every
    real token, so causal attention -- and the recurrence of a hybrid's DeltaNet layers -- keeps it
    out of them). The same modules and the same capture point as the paged forward the proposer is
    fed from at inference; hybrids run that paged forward itself (train/paged_target.py)."""

    def __init__(self, model, taps: list[int]):
        self.model = model
        self.taps = tuple(taps)

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, lengths: torch.Tensor, greedy: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """features [S, T, taps*hidden] (zero past each length); greedy [S, T] or None."""
        hidden, features = dense_forward(self.model, ids, capture_layers=self.taps)
        valid = torch.arange(ids.shape[1], device=ids.device)[None, :] < lengths.to(ids.device)[:, None]
        features = features * valid[..., None].to(features.dtype)
        if not greedy:
            return features, None
        nxt = self.model.compute_logits(hidden).argmax(-1)
        return features, nxt.masked_fill(~valid, 0)
