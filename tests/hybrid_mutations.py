"""Mutated qwen35moe GGUF files (the house style of tests/mutations.py): a tiny valid file in llama.cpp's
names and layout, written with the `gguf` package alone (Gated DeltaNet layer, gated attention layer,
Q8_0 experts, a shared expert), then one metadata key or tensor changed per case. Each case's
LuceboxError must name the key or tensor at fault."""
from __future__ import annotations

import numpy as np
from gguf import GGUFValueType

from tests.family_mutations import ArchFiles
from tests.mutations import MERGES, TOKENS, VOCAB, Case

ARCH = "qwen35moe"
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, EXPERT_FFN, SHARED_FFN = 32, 2, 1, 16, 4, 32, 32
K_HEADS, V_HEADS, STATE, CONV = 1, 2, 16, 4
CONV_CHANNELS = 2 * K_HEADS * STATE + V_HEADS * STATE
U32, F32, S, ARR = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.STRING, GGUFValueType.ARRAY


def metadata() -> dict[str, tuple[object, GGUFValueType, GGUFValueType | None]]:
    keys = {"block_count": 2, "context_length": 256, "embedding_length": HIDDEN, "attention.head_count": HEADS,
            "attention.head_count_kv": KV_HEADS, "attention.key_length": HEAD_DIM,
            "attention.value_length": HEAD_DIM, "rope.dimension_count": 4, "expert_count": EXPERTS,
            "expert_used_count": 2, "expert_feed_forward_length": EXPERT_FFN,
            "expert_shared_feed_forward_length": SHARED_FFN, "ssm.conv_kernel": CONV, "ssm.state_size": STATE,
            "ssm.group_count": K_HEADS, "ssm.time_step_rank": V_HEADS, "ssm.inner_size": V_HEADS * STATE,
            "full_attention_interval": 2}
    out = {f"{ARCH}.{key}": (value, U32, None) for key, value in keys.items()}
    out.update({
        f"{ARCH}.rope.freq_base": (10000.0, F32, None),
        f"{ARCH}.attention.layer_norm_rms_epsilon": (1e-6, F32, None),
        f"{ARCH}.rope.dimension_sections": ([1, 1, 0, 0], ARR, GGUFValueType.INT32),  # 2 rotary pairs
        "tokenizer.ggml.model": ("gpt2", S, None),
        "tokenizer.ggml.pre": ("default", S, None),
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
           "output.weight": w(VOCAB, HIDDEN)}
    linear = {"attn_qkv.weight": w(CONV_CHANNELS, HIDDEN), "attn_gate.weight": w(V_HEADS * STATE, HIDDEN),
              "ssm_alpha.weight": w(V_HEADS, HIDDEN), "ssm_beta.weight": w(V_HEADS, HIDDEN),
              "ssm_a": -np.exp(w(V_HEADS)), "ssm_dt.bias": w(V_HEADS), "ssm_conv1d.weight": w(CONV_CHANNELS, CONV),
              "ssm_norm.weight": w(STATE, base=1.0), "ssm_out.weight": w(HIDDEN, V_HEADS * STATE)}
    attention = {"attn_q.weight": w(2 * HEADS * HEAD_DIM, HIDDEN), "attn_k.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
                 "attn_v.weight": w(KV_HEADS * HEAD_DIM, HIDDEN), "attn_output.weight": w(HIDDEN, HEADS * HEAD_DIM),
                 "attn_q_norm.weight": w(HEAD_DIM, base=1.0), "attn_k_norm.weight": w(HEAD_DIM, base=1.0)}
    for layer, mixer in enumerate((linear, attention)):
        moe = {"attn_norm.weight": w(HIDDEN, base=1.0), "post_attention_norm.weight": w(HIDDEN, base=1.0),
               "ffn_gate_inp.weight": w(EXPERTS, HIDDEN), "ffn_gate_exps.weight": w(EXPERTS, EXPERT_FFN, HIDDEN),
               "ffn_up_exps.weight": w(EXPERTS, EXPERT_FFN, HIDDEN),
               "ffn_down_exps.weight": w(EXPERTS, HIDDEN, EXPERT_FFN), "ffn_gate_inp_shexp.weight": w(1, HIDDEN),
               "ffn_gate_shexp.weight": w(SHARED_FFN, HIDDEN), "ffn_up_shexp.weight": w(SHARED_FFN, HIDDEN),
               "ffn_down_shexp.weight": w(HIDDEN, SHARED_FFN)}
        out.update({f"blk.{layer}.{name}": values for name, values in {**mixer, **moe}.items()})
    return out


FILES = ArchFiles(ARCH, metadata, tensors, "hybrid")
write_hybrid_gguf = FILES.write


def hybrid_cases() -> list[Case]:
    m, t = FILES.meta_case, FILES.tensor_case
    return [
        m("hybrid_expert_count_6", "expert_count", 6,
          r"blk\.0\.ffn_gate_inp\.weight has shape \[4, 32\], but qwen35moe\.expert_count \(6\)"),
        m("hybrid_expert_count_1e6", "expert_count", 10 ** 6, r"qwen35moe\.expert_count"),
        m("hybrid_expert_used_count_5", "expert_used_count", 5, "num_experts_per_tok"),
        m("hybrid_expert_ffn_64", "expert_feed_forward_length", 64,
          r"blk\.0\.ffn_gate_exps\.weight has shape \[4, 32, 32\].*expert_feed_forward_length \(64\)"),
        m("hybrid_shared_ffn_64", "expert_shared_feed_forward_length", 64, r"blk\.0\.ffn_gate_shexp\.weight"),
        m("hybrid_time_step_rank_1e7", "ssm.time_step_rank", 10 ** 7, r"qwen35moe\.ssm\.time_step_rank"),
        m("hybrid_inner_size_not_multiple", "ssm.inner_size", 33,
          r"qwen35moe\.ssm\.inner_size \(33\) is not a multiple"),
        m("hybrid_state_size_8", "ssm.state_size", 8, r"blk\.0\.attn_qkv\.weight has shape"),
        m("hybrid_conv_kernel_3", "ssm.conv_kernel", 3, r"blk\.0\.ssm_conv1d\.weight has shape \[64, 4\]"),
        m("hybrid_ssm_key_missing", "ssm.group_count", None, r"qwen35moe\.ssm\.group_count is missing"),
        m("hybrid_interval_zero", "full_attention_interval", 0, r"full_attention_interval must be at least 1"),
        m("hybrid_interval_1", "full_attention_interval", 1, r"missing tensor blk\.0\.attn_q\.weight"),
        m("hybrid_recurrent_layers_short", "attention.recurrent_layers", [True], r"attention\.recurrent_layers",
          ARR, GGUFValueType.BOOL),
        m("hybrid_rope_dims_32", "rope.dimension_count", 32, r"rope\.dimension_count \(32\) exceeds"),
        m("hybrid_nextn_2", "nextn_predict_layers", 2, r"nextn_predict_layers \(2\) leaves no layers"),
        m("hybrid_block_count_1e6", "block_count", 10 ** 6, r"qwen35moe\.block_count"),
        t("hybrid_missing_ssm_a", lambda v: v.pop("blk.0.ssm_a"), r"missing tensor blk\.0\.ssm_a"),
        t("hybrid_missing_up_exps", lambda v: v.pop("blk.1.ffn_up_exps.weight"),
          r"missing tensor blk\.1\.ffn_up_exps\.weight"),
        t("hybrid_positive_ssm_a", lambda v: v.update({"blk.0.ssm_a": np.ones(V_HEADS, np.float32)}),
          r"blk\.0\.ssm_a holds -exp\(A_log\)"),
        t("hybrid_experts_short",
          lambda v: v.update({"blk.1.ffn_down_exps.weight": v["blk.1.ffn_down_exps.weight"][:3]}),
          r"blk\.1\.ffn_down_exps\.weight has shape \[3, 32, 32\]"),
    ]


def hybrid_flip_cases(count: int = 40, seed: int = 4321) -> list[Case]:
    return FILES.flip_cases(count, seed)
