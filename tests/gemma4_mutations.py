"""Mutated gemma4 GGUF files (the house style of tests/mutations.py): a tiny valid file in llama.cpp's names
and layout, written with the `gguf` package alone (a sliding and two full layers, the last sharing K/V,
k = v on full layers, per-layer inputs, Q8_0 experts fused gate/up, proportional RoPE as rope_freqs, a
gemma4 vocabulary), then one metadata key or tensor changed per case. Each case's LuceboxError must name
the key or tensor at fault."""
from __future__ import annotations

import numpy as np
from gguf import GGUFValueType

from tests.family_mutations import ArchFiles
from tests.mutations import MERGES, TOKENS, VOCAB, Case

ARCH = "gemma4"
HIDDEN, HEADS, SWA_DIM, FULL_DIM, FFN, EXPERTS, EXPERT_FFN, PER_LAYER = 32, 2, 8, 16, 64, 4, 32, 8
TYPES = [True, False, False]  # sliding, full, full (shares layer 1's K/V)
U32, F32, S, ARR = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.STRING, GGUFValueType.ARRAY


def metadata() -> dict[str, tuple[object, GGUFValueType, GGUFValueType | None]]:
    keys = {"block_count": 3, "context_length": 256, "embedding_length": HIDDEN, "feed_forward_length": FFN,
            "attention.head_count": HEADS, "attention.key_length": FULL_DIM, "attention.value_length": FULL_DIM,
            "attention.key_length_swa": SWA_DIM, "attention.value_length_swa": SWA_DIM,
            "rope.dimension_count": FULL_DIM, "rope.dimension_count_swa": SWA_DIM, "attention.sliding_window": 4,
            "attention.shared_kv_layers": 1, "embedding_length_per_layer_input": PER_LAYER,
            "expert_count": EXPERTS, "expert_used_count": 2, "expert_feed_forward_length": EXPERT_FFN}
    out = {f"{ARCH}.{key}": (value, U32, None) for key, value in keys.items()}
    out.update({
        f"{ARCH}.attention.head_count_kv": ([2, 1, 1], ARR, GGUFValueType.INT32),
        f"{ARCH}.attention.sliding_window_pattern": (TYPES, ARR, GGUFValueType.BOOL),
        f"{ARCH}.rope.freq_base": (1e6, F32, None), f"{ARCH}.rope.freq_base_swa": (1e4, F32, None),
        f"{ARCH}.attention.layer_norm_rms_epsilon": (1e-6, F32, None),
        f"{ARCH}.final_logit_softcapping": (30.0, F32, None),
        "tokenizer.ggml.model": ("gemma4", S, None),
        "tokenizer.ggml.tokens": (TOKENS, ARR, S),
        "tokenizer.ggml.token_type": ([1] * (VOCAB - 1) + [3], ARR, GGUFValueType.INT32),
        "tokenizer.ggml.merges": (MERGES, ARR, S),
        "tokenizer.ggml.eos_token_id": (VOCAB - 1, U32, None),
    })
    return out


def tensors(seed: int = 0) -> dict[str, np.ndarray]:
    """llama.cpp name -> float32 values (outermost first); experts are quantised to Q8_0 on writing."""
    rng = np.random.default_rng(seed)

    def w(*shape, base=0.0):
        return (rng.standard_normal(shape) * 0.1 + base).astype(np.float32)

    out = {"token_embd.weight": w(VOCAB, HIDDEN), "output_norm.weight": w(HIDDEN, base=1.0),
           "per_layer_token_embd.weight": w(VOCAB, 3 * PER_LAYER),
           "per_layer_model_proj.weight": w(3 * PER_LAYER, HIDDEN),
           "per_layer_proj_norm.weight": w(PER_LAYER, base=1.0),
           "rope_freqs.weight": np.array([1.0, 1.0] + [1e30] * 6, np.float32)}  # a quarter of the 8 pairs turn
    for layer, sliding in enumerate(TYPES):
        dim, kv = (SWA_DIM, 2) if sliding else (FULL_DIM, 1)
        block = {"attn_norm.weight": w(HIDDEN, base=1.0), "attn_q.weight": w(HEADS * dim, HIDDEN),
                 "attn_q_norm.weight": w(dim, base=1.0), "attn_output.weight": w(HIDDEN, HEADS * dim),
                 "post_attention_norm.weight": w(HIDDEN, base=1.0), "ffn_norm.weight": w(HIDDEN, base=1.0),
                 "ffn_gate.weight": w(FFN, HIDDEN), "ffn_up.weight": w(FFN, HIDDEN), "ffn_down.weight": w(HIDDEN, FFN),
                 "post_ffw_norm.weight": w(HIDDEN, base=1.0), "ffn_gate_inp.weight": w(EXPERTS, HIDDEN),
                 "ffn_gate_inp.scale": w(HIDDEN, base=1.0), "ffn_down_exps.scale": w(EXPERTS, base=1.0),
                 "ffn_gate_up_exps.weight": w(EXPERTS, 2 * EXPERT_FFN, HIDDEN),
                 "ffn_down_exps.weight": w(EXPERTS, HIDDEN, EXPERT_FFN), "pre_ffw_norm_2.weight": w(HIDDEN, base=1.0),
                 "post_ffw_norm_1.weight": w(HIDDEN, base=1.0), "post_ffw_norm_2.weight": w(HIDDEN, base=1.0),
                 "layer_output_scale.weight": w(1, base=1.0), "inp_gate.weight": w(PER_LAYER, HIDDEN),
                 "proj.weight": w(HIDDEN, PER_LAYER), "post_norm.weight": w(HIDDEN, base=1.0)}
        if layer < 2:  # the last layer reads layer 1's K/V; full layers take v from k
            block.update({"attn_k.weight": w(kv * dim, HIDDEN), "attn_k_norm.weight": w(dim, base=1.0)})
            if sliding:
                block["attn_v.weight"] = w(kv * dim, HIDDEN)
        out.update({f"blk.{layer}.{name}": values for name, values in block.items()})
    return out


FILES = ArchFiles(ARCH, metadata, tensors, "gemma4")
write_gemma4_gguf = FILES.write


def gemma4_cases() -> list[Case]:
    m, t, i32, b = FILES.meta_case, FILES.tensor_case, GGUFValueType.INT32, GGUFValueType.BOOL
    return [
        m("gemma4_expert_count_6", "expert_count", 6, r"blk\.0\.ffn_down_exps\.scale has shape \[4\], but "
                                                      r"gemma4\.expert_count \(6\)"),
        m("gemma4_expert_used_count_5", "expert_used_count", 5, "num_experts_per_tok"),
        m("gemma4_expert_ffn_64", "expert_feed_forward_length", 64,
          r"blk\.0\.ffn_gate_up_exps\.weight has shape \[4, 64, 32\].*expert_feed_forward_length \(64\)"),
        m("gemma4_key_length_32", "attention.key_length", 32, r"gemma4\.attention\.value_length differs"),
        m("gemma4_key_length_swa_4", "attention.key_length_swa", 4, r"gemma4\.attention\.value_length_swa differs"),
        m("gemma4_heads_4", "attention.head_count", 4, r"blk\.0\.attn_q\.weight has shape \[16, 32\], but gemma4"),
        m("gemma4_value_length_8", "attention.value_length", 8, r"gemma4\.attention\.value_length differs"),
        m("gemma4_partial_rope", "rope.dimension_count", 8, r"gemma4\.rope\.dimension_count is not the head size"),
        m("gemma4_kv_heads_short", "attention.head_count_kv", [2, 1], r"head_count_kv has 2 entries for 3 layers",
          ARR, i32),
        m("gemma4_kv_heads_huge", "attention.head_count_kv", [2, 1, 10 ** 9],
          r"every entry of metadata key gemma4\.attention\.head_count_kv must be an integer from", ARR, i32),
        m("gemma4_kv_heads_3", "attention.head_count_kv", [3, 1, 1],
          r"gemma4\.attention\.head_count \(2\) must be a multiple of every layer's gemma4\.attention\.head_count_kv, "
          r"got \[3, 1, 1\]",
          ARR, i32),
        m("gemma4_pattern_missing", "attention.sliding_window_pattern", None,
          r"required metadata key gemma4\.attention\.sliding_window_pattern is missing"),
        m("gemma4_pattern_short", "attention.sliding_window_pattern", [True], r"sliding_window_pattern should hold",
          ARR, b),
        m("gemma4_window_missing", "attention.sliding_window", None, r"gemma4\.attention\.sliding_window is missing"),
        m("gemma4_shared_3", "attention.shared_kv_layers", 3, r"gemma4\.attention\.shared_kv_layers \(3\)"),
        m("gemma4_shared_0", "attention.shared_kv_layers", 0, r"missing tensor blk\.2\.attn_k\.weight"),
        m("gemma4_ffn_widths", "feed_forward_length", [64, 64, 100], r"feed_forward_length \[64, 64, 100\] is neither",
          ARR, i32),
        m("gemma4_per_layer_16", "embedding_length_per_layer_input", 16,
          r"blk\.0\.inp_gate\.weight has shape \[8, 32\], but gemma4\.embedding_length_per_layer_input \(16\)"),
        m("gemma4_block_count_1e6", "block_count", 10 ** 6, r"gemma4\.block_count"),
        t("gemma4_missing_rope_freqs", lambda v: v.pop("rope_freqs.weight"), r"missing tensor rope_freqs\.weight"),
        t("gemma4_bad_rope_freqs", lambda v: v.update({"rope_freqs.weight": np.full(8, 2.0, np.float32)}),
          r"rope_freqs\.weight holds factors other than 1"),
        t("gemma4_missing_k_norm", lambda v: v.pop("blk.1.attn_k_norm.weight"), r"missing tensor blk\.1\.attn_k_norm"),
        t("gemma4_missing_router_scale", lambda v: v.pop("blk.2.ffn_down_exps.scale"),
          r"missing tensor blk\.2\.ffn_down_exps\.scale"),
        t("gemma4_experts_short",
          lambda v: v.update({"blk.1.ffn_down_exps.weight": v["blk.1.ffn_down_exps.weight"][:3]}),
          r"blk\.1\.ffn_down_exps\.weight has shape \[3, 32, 32\]"),
    ]


def gemma4_flip_cases(count: int = 30, seed: int = 8642) -> list[Case]:
    return FILES.flip_cases(count, seed)
