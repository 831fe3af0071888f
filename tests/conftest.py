"""Fixtures: tiny random models of each supported family, built with transformers (the reference)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TRAINING_TEXT = """
def fibonacci(n):
    \"\"\"Return the n-th Fibonacci number.\"\"\"
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

class Stack:
    def __init__(self):
        self.items = []
    def push(self, item):
        self.items.append(item)
    def pop(self):
        return self.items.pop()

The quick brown fox jumps over the lazy dog. Über naïve café — 東京 🙂 12345 67890.
import os, sys, json
print("hello world", sum(range(10)))
""" * 4


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer (vocab 384) with ChatML specials, as HF tokenizer files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TRAINING_TEXT], trainer)
    out = tmp_path_factory.mktemp("tokenizer")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "chat_template": CHATML_TEMPLATE, "model_max_length": 512}))
    return out


FAMILIES = {
    "llama": dict(model_type="llama", rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 64}),
    "llama-linear-bias": dict(model_type="llama", attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
                              rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    "mistral": dict(model_type="mistral", sliding_window=7, rope_parameters={"rope_type": "default",
                                                                             "rope_theta": 1e6}),
    "qwen2": dict(model_type="qwen2", use_sliding_window=True, sliding_window=6, max_window_layers=1,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                   "original_max_position_embeddings": 64}),
    "qwen3": dict(model_type="qwen3", head_dim=24, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
}

# Mixture-of-experts families (tests/model/test_moe.py), apart from FAMILIES, which GGUF tests convert.
MOE_FAMILIES = {
    "qwen3_moe": dict(model_type="qwen3_moe", head_dim=16, num_hidden_layers=4, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32, mlp_only_layers=[0], decoder_sparse_step=1, norm_topk_prob=True,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "qwen3_moe-step2": dict(model_type="qwen3_moe", head_dim=16, num_hidden_layers=4, num_experts=8,
                            num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[], decoder_sparse_step=2,
                            norm_topk_prob=False, tie_word_embeddings=True,
                            rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
}


def build_hf_model(family: str, out: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """Save a random-initialised transformers model of `family` (plus tokenizer files) to `out`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(FAMILIES[family] if family in FAMILIES else MOE_FAMILIES[family])
    spec.update(overrides)
    model_type = spec.pop("model_type")
    vocab = json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"]
    kwargs = dict(vocab_size=len(vocab) + 3, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, eos_token_id=vocab.get("<|im_end|>", 2), bos_token_id=None,
                  tie_word_embeddings=False)
    kwargs.update(spec)
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random norms too, so a norm-weight mix-up cannot hide
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(out, safe_serialization=True)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / file, out / file)
    return out


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    return {family: build_hf_model(family, tmp_path_factory.mktemp(family), tokenizer_dir) for family in FAMILIES}
