"""llama.cpp's `laguna` metadata (Poolside Laguna) <-> LagunaConfig: what its converter writes
(conversion/laguna.py + base.py) and what its loader reads (src/models/laguna.cpp), key names as in
gguf-py's constants.py of the same tree (the installed `gguf` package predates the architecture).

  laguna.attention.head_count               one query-head count per layer (an array; a scalar for all)
  laguna.attention.sliding_window           the window; absent or 0: every layer attends fully
  laguna.attention.sliding_window_pattern   one bool per layer (true: sliding); else an integer n (default 4)
                                            with layer i full where i % n == 0 (llama.cpp's dense-first rule)
  laguna.rope.freq_base / dimension_count   the full-attention layers' RoPE (YaRN keys as for any arch)
  laguna.rope.freq_base_swa / dimension_count_swa   the sliding layers' plain RoPE
  laguna.leading_dense_block_count          the first N layers have a dense FFN, the rest the MoE block
  laguna.expert_gating_func                 1 softmax, 2 sigmoid (the default) router scores
  laguna.expert_weights_norm / _scale       renormalise the top-k weights / the routed scaling factor
  laguna.expert_shared_feed_forward_length  the (ungated) shared expert's width
  laguna.router_logit_softcapping           written by lucebox only where the config soft-caps; llama.cpp's
                                            laguna graph has no soft-cap and ignores the key
The output gate's granularity is not a key: blk.N.attn_gate.weight has one row per head or per channel.
"""
from __future__ import annotations

import logging

from gguf import ExpertGatingFuncType

from ..errors import CheckpointError, UnsupportedError
from .config import RopeConfig
from .gguf_config import Metadata, rope_config
from .rope import rotary_dim
from .laguna_config import FULL, SLIDING, LagunaConfig

log = logging.getLogger("lucebox")

ARCH = "laguna"
DEFAULT_SWA_PERIOD = 4  # llama.cpp's laguna: load_swa_pattern(ml, 4, dense_first=true)
SOFTMAX, SIGMOID = int(ExpertGatingFuncType.SOFTMAX), int(ExpertGatingFuncType.SIGMOID)


def key(suffix: str) -> str:
    return f"{ARCH}.{suffix}"


def laguna_model_config(meta: Metadata, shapes: dict[str, tuple[int, ...]]) -> LagunaConfig:
    """LagunaConfig of a `laguna` file; `shapes`: GGUF tensor name -> shape (outermost first)."""
    layers = meta.integer(key("block_count"), required=True, limit="num_layers")
    hidden = meta.integer(key("embedding_length"), required=True, limit="hidden_size")
    heads = _head_counts(meta, layers)
    head_dim = meta.integer(key("attention.key_length"), None, limit="head_dim") or hidden // heads[0]
    if meta.integer(key("attention.value_length"), head_dim) != head_dim:
        raise UnsupportedError(f"{meta.path}: {key('attention.value_length')} != {key('attention.key_length')} "
                               "is not supported")
    context = meta.integer(key("context_length"), required=True, limit="max_position_embeddings")
    vocab = (meta.integer(key("vocab_size"), None, limit="vocab_size") or meta.array_len("tokenizer.ggml.tokens")
             or shapes.get("token_embd.weight", (0,))[0])
    eos = [meta.integer(f"tokenizer.ggml.{k}_token_id", limit="token_id") for k in ("eos", "eot", "eom")]
    full_dims = _rope_dims(meta, "rope.dimension_count", head_dim, head_dim)
    window, kinds = _attention_kinds(meta, layers)
    moe = _moe_fields(meta, layers, shapes)
    dense = meta.integer(key("feed_forward_length"), None, limit="intermediate_size")
    intermediate = dense or moe.get("shared_expert_intermediate_size") or moe.get("moe_intermediate_size")
    if not intermediate:
        raise CheckpointError(f"{meta.path}: required metadata key {key('feed_forward_length')} is missing")
    try:
        return LagunaConfig(
            family="laguna", vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_layers=layers,
            num_heads=heads[0], num_kv_heads=meta.integer(key("attention.head_count_kv"), heads[0],
                                                          limit="num_kv_heads"),
            head_dim=head_dim, max_position_embeddings=context,
            rms_norm_eps=meta.number(key("attention.layer_norm_rms_epsilon"), required=True, limit="rms_norm_eps"),
            rope=rope_config(meta, ARCH, context), partial_rotary_factor=_factor(full_dims, head_dim),
            sliding_rope=RopeConfig(theta=meta.number(key("rope.freq_base_swa"), None, limit="rope_theta")
                                    or meta.number(key("rope.freq_base"), 10000.0, limit="rope_theta")),
            sliding_partial_rotary_factor=_factor(_rope_dims(meta, "rope.dimension_count_swa", full_dims, head_dim),
                                                  head_dim),
            sliding_windows=[window if kind == SLIDING else None for kind in kinds], attention_kinds=kinds,
            heads_per_layer=heads, gate_per_head=_gate_per_head(meta, heads, head_dim, shapes),
            qkv_bias="blk.0.attn_q.bias" in shapes, o_bias="blk.0.attn_output.bias" in shapes,
            tie_word_embeddings="output.weight" not in shapes,
            bos_token_id=meta.integer("tokenizer.ggml.bos_token_id", limit="token_id"),
            eos_token_ids=list(dict.fromkeys(i for i in eos if i is not None)), **moe)
    except CheckpointError as e:
        raise CheckpointError(f"{meta.path}: {e}") from None


def _head_counts(meta: Metadata, layers: int) -> list[int]:
    name = key("attention.head_count")
    value = meta.need(name)
    values = value if isinstance(value, list) else [value] * layers
    if len(values) < layers:
        raise CheckpointError(f"{meta.path}: {name} has {len(values)} entries for {layers} layers")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values[:layers]):
        raise CheckpointError(f"{meta.path}: {name} should hold positive integers, got {values[:8]!r}")
    return [int(v) for v in values[:layers]]


def _rope_dims(meta: Metadata, suffix: str, default: int, head_dim: int) -> int:
    dims = meta.integer(key(suffix), default, limit="head_dim")
    if dims > head_dim or dims % 2:
        raise CheckpointError(f"{meta.path}: {key(suffix)} ({dims}) must be even and at most the head dim "
                              f"({head_dim})")
    return dims


def _factor(dims: int, head_dim: int) -> float:
    """A partial rotary factor whose rotary_dim is `dims` (dims / head_dim can land a hair below it)."""
    factor = dims / head_dim
    return factor if rotary_dim(head_dim, factor) == dims else (dims + 0.5) / head_dim


def _attention_kinds(meta: Metadata, layers: int) -> tuple[int | None, list[str]]:
    """(window, per-layer kind), by llama.cpp's rule: no window, every layer full; else the per-layer
    pattern, or every n-th layer full starting with layer 0."""
    window = meta.integer(key("attention.sliding_window"), 0, limit="count")
    if not window:
        return None, [FULL] * layers
    window = meta.integer(key("attention.sliding_window"), limit="sliding_window")
    name = key("attention.sliding_window_pattern")
    pattern = meta.get(name, DEFAULT_SWA_PERIOD)
    if isinstance(pattern, list):
        if len(pattern) < layers or not all(isinstance(p, bool) for p in pattern):
            raise CheckpointError(f"{meta.path}: {name} should hold a boolean for each of the {layers} layers, "
                                  f"got {pattern!r:.80}")
        return window, [SLIDING if pattern[i] else FULL for i in range(layers)]
    period = meta.integer(name, DEFAULT_SWA_PERIOD, limit="count")
    return window, [SLIDING if period == 0 or i % period else FULL for i in range(layers)]


def _gate_per_head(meta: Metadata, heads: list[int], head_dim: int, shapes) -> bool:
    """The output gate's width, read from the tensors as llama.cpp does: one per head or one per channel,
    the same kind in every layer."""
    kinds = set()
    for i, n in enumerate(heads):
        name = f"blk.{i}.attn_gate.weight"
        if name not in shapes:
            continue  # reported as a missing tensor with the others
        rows = shapes[name][0]
        if rows not in (n, n * head_dim):
            raise CheckpointError(f"{meta.path}: tensor {name} has {rows} rows, but {key('attention.head_count')}"
                                  f"[{i}] ({n}) makes it {n} (a gate per head) or {n * head_dim} (per channel, "
                                  f"{key('attention.key_length')} {head_dim})")
        kinds.add(rows == n)
    if len(kinds) > 1:
        raise UnsupportedError(f"{meta.path}: attn_gate tensors gate per head in some layers and per channel in "
                               "others; lucebox supports one kind per model")
    return kinds.pop() if kinds else True


def _moe_fields(meta: Metadata, layers: int, shapes) -> dict:
    """The MoE block's fields. Layers from leading_dense_block_count on are sparse (llama.cpp's rule); a
    later layer holding a dense FFN and no router is dense too (lucebox writes those; llama.cpp cannot)."""
    lead = meta.integer(key("leading_dense_block_count"), required=True, limit="count")
    sparse = [f"blk.{i}.ffn_gate_inp.weight" in shapes
              or (i >= lead and f"blk.{i}.ffn_gate.weight" not in shapes) for i in range(layers)]
    if not any(sparse):
        return {}
    experts = meta.integer(key("expert_count"), required=True, limit="num_experts")
    width = meta.integer(key("expert_feed_forward_length"), required=True, limit="intermediate_size")
    shared = meta.integer(key("expert_shared_feed_forward_length"), 0, limit="count")
    if not shared:  # llama.cpp: one shared expert of the routed width unless told otherwise
        shared = width * meta.integer(key("expert_shared_count"), 1, limit="count")
    norm = meta.get(key("expert_weights_norm"), False)
    if not isinstance(norm, bool):
        raise CheckpointError(f"{meta.path}: metadata key {key('expert_weights_norm')} should be a boolean, "
                              f"got {norm!r:.60}")
    gating = meta.integer(key("expert_gating_func"), SIGMOID)
    if gating not in (SOFTMAX, SIGMOID):
        raise UnsupportedError(f"{meta.path}: {key('expert_gating_func')} = {gating} is not supported "
                               f"({SOFTMAX}: softmax, {SIGMOID}: sigmoid)")
    scale = meta.number(key("expert_weights_scale"), 0.0)
    softcap = meta.number(key("router_logit_softcapping"), 0.0)
    return dict(num_experts=experts,
                num_experts_per_tok=meta.integer(key("expert_used_count"), required=True, limit="num_experts"),
                moe_intermediate_size=width, shared_expert_intermediate_size=shared, norm_topk_prob=norm,
                moe_layers=sparse, router_sigmoid=gating == SIGMOID,
                routed_scaling_factor=scale or 1.0,  # llama.cpp: 0 (absent) means no scaling
                router_logit_softcap=softcap)


def check_laguna_gguf(cfg: LagunaConfig, shapes: dict[str, tuple[int, ...]], path) -> None:
    """Each layer's query-sized tensors agree with its head count, named by the metadata that sizes them
    (the table-driven check that follows reports the rest)."""
    for i, heads in enumerate(cfg.heads_per_layer):
        rows = heads * cfg.head_dim
        for name, want in ((f"blk.{i}.attn_q.weight", (rows, cfg.hidden_size)),
                           (f"blk.{i}.attn_output.weight", (cfg.hidden_size, rows))):
            if name in shapes and tuple(shapes[name]) != want:
                raise CheckpointError(f"{path}: tensor {name} has shape {list(shapes[name])}, but "
                                      f"{key('attention.head_count')}[{i}] ({heads}) and {key('attention.key_length')} "
                                      f"({cfg.head_dim}) make it {list(want)}")


# ------------------------------------------------------------------------------------------- writing
def write_laguna_keys(w, cfg: LagunaConfig) -> None:
    """The `laguna.*` keys beyond convert.write_shape_metadata's (which writes the per-layer head counts and
    the full-attention layers' RoPE); refuses what llama.cpp's laguna has no key for."""
    if cfg.router_weights_on_input:
        raise UnsupportedError("laguna: moe_apply_router_weight_on_input has no GGUF key; lucebox cannot write it")
    sliding = [i for i, kind in enumerate(cfg.attention_kinds) if kind == SLIDING]
    windows = {cfg.sliding_windows[i] for i in sliding}
    if len(windows) > 1 or None in windows:
        raise UnsupportedError(f"laguna: sliding layers need one sliding_window, got {sorted(map(str, windows))}")
    if sliding:
        if cfg.sliding_rope.type != "default":
            raise UnsupportedError(f"laguna: RoPE scaling {cfg.sliding_rope.type!r} on the sliding-window layers "
                                   "has no GGUF key (llama.cpp runs plain RoPE there)")
        w.add_sliding_window(windows.pop())
        w.add_sliding_window_pattern([kind == SLIDING for kind in cfg.attention_kinds])
        w.add_rope_freq_base_swa(cfg.sliding_rope.theta)
        w.add_rope_dimension_count_swa(rotary_dim(cfg.head_dim, cfg.sliding_partial_rotary_factor))
    lead = next((i for i, sparse in enumerate(cfg.moe_layers) if sparse), cfg.num_layers)
    w.add_leading_dense_block_count(lead)
    if not cfg.num_experts:
        return
    if not all(cfg.moe_layers[lead:]):
        log.warning("laguna: dense FFN layers after the first MoE layer: lucebox reads them back, llama.cpp "
                    "expects every layer from %s.leading_dense_block_count (%d) on to be sparse", ARCH, lead)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    w.add_expert_weights_norm(cfg.norm_topk_prob)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID if cfg.router_sigmoid else ExpertGatingFuncType.SOFTMAX)
    if cfg.router_logit_softcap:
        w.add_router_logit_softcapping(cfg.router_logit_softcap)
        log.warning("laguna: router logit soft-capping (%s) is written as %s, which lucebox reads back and "
                    "llama.cpp's laguna ignores", cfg.router_logit_softcap, key("router_logit_softcapping"))
    if not cfg.shared_expert_intermediate_size:
        log.warning("laguna: no shared expert; llama.cpp's laguna expects one in every MoE layer")
