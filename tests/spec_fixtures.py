"""Models for speculative-decoding tests: draft models sharing a target's tokenizer, random DFlash
drafters in the published layout, and a small-vocabulary pair with peaked distributions."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from lucebox.model.config import ModelConfig
from lucebox.spec.dflash_model import DFlashConfig, DFlashDrafter, save_drafter


def write_dflash_drafter(target_dir: Path, out: Path, taps=(0, 1), block_size: int = 8, layers: int = 2,
                         seed: int = 0, **overrides) -> Path:
    """A random-weight DFlash drafter for the HF target in target_dir, in the z-lab layout."""
    t = ModelConfig.from_hf_dir(target_dir)
    m = ModelConfig(family="qwen3", vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=96,
                    num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=16,
                    max_position_embeddings=t.max_position_embeddings, qk_norm=True)
    cfg = DFlashConfig(m, list(taps), overrides.pop("mask_token_id", t.vocab_size - 1), block_size, t.num_layers)
    torch.manual_seed(seed)
    drafter = DFlashDrafter(cfg)
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.1) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    save_drafter(drafter, out)
    if overrides:
        raw = json.loads((out / "config.json").read_text())
        raw.update(overrides)
        (out / "config.json").write_text(json.dumps(raw))
    return out


def small_vocab_tokenizer(out: Path, words: list[str]) -> Path:
    """A word-level tokenizer over `words` (plus an end token), as HF tokenizer files."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(words + ["<|im_end|>"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "bos_token": None}))
    return out


def peaked_model(out: Path, tokenizer: Path, layers: int, seed: int, head_std: float = 1.0,
                 model_type: str = "qwen3", **overrides) -> Path:
    """A tiny Qwen3 (or `model_type` with config `overrides`) whose LM head is large enough that
    next-token distributions are far from uniform."""
    from transformers import AutoConfig, AutoModelForCausalLM

    vocab = len(json.loads((tokenizer / "tokenizer.json").read_text())["model"]["vocab"])
    base = {"vocab_size": vocab, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": layers,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64,
            "tie_word_embeddings": False, "eos_token_id": vocab - 1, "bos_token_id": None}
    config = AutoConfig.for_model(model_type, **(base | overrides))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.normal_(0, head_std)
        model.model.embed_tokens.weight.normal_(0, 1.0)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((tokenizer / name).read_bytes())
    return out
