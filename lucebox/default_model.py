"""The default model pair used when no --model is given.

lucebox ships a small trained code model under models/ (see models/default/README.md) and, once
one reaches the quality bar, its DFlash drafter; with no --model, lucebox serves it with
speculation on (the drafter, else n-gram lookup).
An installed wheel carries the same files as lucebox/bundled_models (setup.py maps models/ there).
Where neither is present (a copy of the package without the repository's models), a small
Qwen3-architecture model with a trained tokenizer and RANDOM weights is built on first use, so
the stack still runs offline; its output is not meaningful text.
"""
from __future__ import annotations

import json
import logging
import shutil
import sysconfig
from pathlib import Path

import torch

from .config import SpeculativeConfig, cache_dir

log = logging.getLogger("lucebox")

_PACKAGE = Path(__file__).resolve().parent
# the wheel's copy first; a checkout (or an editable install) reads the repository's models/
MODELS = next((d for d in (_PACKAGE / "bundled_models", _PACKAGE.parent / "models") if d.is_dir()),
              _PACKAGE.parent / "models")
BUNDLED = MODELS / "default"
BUNDLED_DRAFTER = MODELS / "default-dflash"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
                  "<tool_call>", "</tool_call>", "<|mask|>"]
CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CONFIG = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=256, intermediate_size=768,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
              max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True,
              hidden_act="silu", torch_dtype="float32")


def default_speculative_config() -> SpeculativeConfig | None:
    """Speculation for the default model: n-gram lookup first, its DFlash drafter where lookup finds
    nothing (the small code model repeats itself a lot, which lookup drafts for free; BENCHMARKS.md);
    n-gram lookup alone when the drafter is not there. The random demo model gets none."""
    if not (BUNDLED / "config.json").is_file():
        return None
    if (BUNDLED_DRAFTER / "config.json").is_file():
        return SpeculativeConfig(method="dflash", model=str(BUNDLED_DRAFTER), ngram_first=True)
    return SpeculativeConfig(method="ngram")


def default_model_path() -> Path:
    if (BUNDLED / "config.json").is_file():
        return BUNDLED
    cache = cache_dir() / "random-qwen3-demo"
    if not (cache / "model.safetensors").is_file():
        build_demo_model(cache)
    return cache


def build_demo_model(out: Path, vocab_size: int = 4096, seed: int = 0) -> Path:
    """Write a HF-format model directory: tokenizer trained on stdlib code, random weights."""
    from safetensors.torch import save_file

    from .model.config import ModelConfig
    from .model.transformer import Transformer

    log.warning("building the demo model (random weights, untrained) in %s", out)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tokenizer = _train_tokenizer(vocab_size)
    tokenizer.save(str(tmp / "tokenizer.json"))
    eos = tokenizer.token_to_id("<|im_end|>")
    config = dict(CONFIG, vocab_size=tokenizer.get_vocab_size(), eos_token_id=eos, bos_token_id=None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    (tmp / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "chat_template": CHATML}, indent=2))
    (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "temperature": 0.7,
                                                            "top_p": 0.95, "do_sample": True}, indent=2))
    torch.manual_seed(seed)
    model = Transformer(ModelConfig.from_hf_dict(config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    save_file({name: t.contiguous() for name, t in _hf_state_dict(model).items()}, str(tmp / "model.safetensors"))
    if out.exists():  # an incomplete earlier build
        shutil.rmtree(out)
    tmp.replace(out)
    return out


def _hf_state_dict(model) -> dict[str, torch.Tensor]:
    return {("model." + k if not k.startswith("lm_head") else k): v for k, v in model.state_dict().items()}


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(str(p) for p in stdlib.glob("*.py"))[:200]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(files, trainer)
    return tok
